"""The numerics cases: per-row reductions of logits as users write them, with the upcast
dtype as a parameter ``up`` (FP32 in the compiled runs, FP64 in the reference), and their
inputs.  Shared by test_numerics, test_lm_head and test_gpu."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.numerics import F32

__all__ = ["logprob", "logprob_entropy", "entropy_lse_form", "policy_loss", "shifted_bsv", "cross_entropy",
           "logits", "tokens_for", "labels_for", "lm_logprob_entropy"]


def logprob(x, tok, up=F32):
    logp = torch.log_softmax(x.to(up) / 0.7, dim=-1)
    return logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def logprob_entropy(x, tok, up=F32):
    z = x.to(up) / 0.7
    logp = torch.log_softmax(z, dim=-1)
    entropy = -(torch.softmax(z, -1) * logp).sum(-1)
    return logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1), entropy


def entropy_lse_form(x, up=F32):
    z = x.to(up)
    return torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)


def policy_loss(x, tok, adv, up=F32):
    lp, ent = logprob_entropy(x, tok, up)
    return -(lp * adv.to(up)).mean() - 0.01 * ent.mean()


def shifted_bsv(x, tok, t, up=F32):
    # [B, S, V] logits, next-token shift, temperature as a 0-d tensor divided in model precision
    logp = F.log_softmax((x[:, :-1] / t).to(up), -1)
    lp = logp.gather(-1, tok[:, 1:].unsqueeze(-1)).squeeze(-1)
    return -lp.sum()


def cross_entropy(x, labels, reduction, up=F32):
    return F.cross_entropy(x.to(up), labels, ignore_index=-100, reduction=reduction)


def logits(T, V, dtype, mask_frac=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, V, generator=g) * 3
    if mask_frac:
        x[torch.rand(T, V, generator=g) < mask_frac] = float("-inf")
    return x.to(dtype)


def tokens_for(x, seed=1):
    """Tokens that are never masked (-inf), as a sampler would give."""
    g = torch.Generator().manual_seed(seed)
    w = torch.isfinite(x.float()).float().reshape(-1, x.shape[-1])
    return torch.multinomial(w, 1, generator=g).reshape(x.shape[:-1])


def labels_for(x, ignore_frac, seed=2):
    labels = tokens_for(x, seed)
    g = torch.Generator().manual_seed(seed)
    labels[torch.rand(labels.shape, generator=g) < ignore_frac] = -100
    return labels


def lm_logprob_entropy(hidden, weight, tok, adv, up=F32):
    logits = hidden @ weight.T
    z = logits.to(up) / 0.7
    logp = torch.log_softmax(z, -1)
    entropy = -(torch.softmax(z, -1) * logp).sum(-1)
    lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    return -(lp * adv.to(up)).mean() - 0.01 * entropy.mean()
