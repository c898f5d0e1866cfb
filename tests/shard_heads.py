"""The vocab-parallel heads the tests compile, written the Megatron way on the local
shard with collectives on per-row tensors (tests/test_vocab_parallel.py, and the fresh
process of its warm-start test, tests/vocab_parallel_child.py).  They need an initialized
process group (the tests use a one-rank gloo group)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

T, V = 37, 1000  # rows not a multiple of anything; the whole vocabulary is this rank's


def all_reduce(v, op):
    """All-reduce forward, identity backward (the docs' spelling)."""
    return funcol.all_reduce(v.detach(), op, dist.group.WORLD) + (v - v.detach())


def shifted(local, up, t=0.7):
    z = local.to(up) / t
    m = funcol.all_reduce(z.detach().amax(-1), "max", dist.group.WORLD)
    return z - m.unsqueeze(-1)


def logprob(local, tok, up=torch.float32):
    z = shifted(local, up)
    s = all_reduce(z.exp().sum(-1), "sum")
    lo = 0
    own = (tok >= lo) & (tok < lo + local.shape[-1])
    picked = z.gather(-1, torch.where(own, tok - lo, 0).unsqueeze(-1)).squeeze(-1)
    return all_reduce(torch.where(own, picked, 0.0), "sum") - s.log()


def logprob_unshifted(local, tok, up=torch.float32):
    """Issue 21's spelling: the target logit gathered from the unshifted ``z``, the max
    subtracted from the per-row result (the gather reads no earlier stage's result)."""
    z = local.to(up) / 0.7
    m = funcol.all_reduce(z.amax(-1).detach(), "max", dist.group.WORLD)
    se = all_reduce((z - m.unsqueeze(-1)).exp().sum(-1), "sum")
    own = (tok >= 0) & (tok < local.shape[-1])
    target = z.gather(-1, torch.where(own, tok, 0)[:, None]).squeeze(-1)
    picked = all_reduce(torch.where(own, target, 0.0), "sum")
    return picked - m - se.log()


def entropy(local, tok, up=torch.float32):
    z = shifted(local, up)
    e = z.exp()
    s = all_reduce(e.sum(-1), "sum")
    return s.log() - all_reduce((e * z).sum(-1), "sum") / s


def cross_entropy(local, tok, up=torch.float32):
    valid = tok != -100
    lp = logprob(local, torch.where(valid, tok, 0), up)
    return -torch.where(valid, lp, 0.0).sum() / valid.sum()


def logprob_inplace(local, tok, up=torch.float32):
    """Megatron's own spelling: in-place ``dist.all_reduce`` (Dynamo: ``m.copy_(...)``)."""
    z = local.to(up) / 0.7
    m = z.detach().amax(-1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    z = z - m.unsqueeze(-1)
    s = z.exp().sum(-1)
    dist.all_reduce(s)
    return z.gather(-1, tok.unsqueeze(-1)).squeeze(-1) - s.log()


HEADS = [logprob, entropy, cross_entropy, logprob_inplace, logprob_unshifted]


def inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(T, V, generator=g) * 4).to(dtype)
    tok = torch.randint(0, V, (T,), generator=g)
    tok[::5] = -100
    return [x, tok]


# --- the lm_head matmul inside the loop (fx_passes.kernels.log_softmax.shard) ---------------------

H = 32


def with_lm_head(head):
    def fn(h, w, tok, up=torch.float32):
        return head(h @ w.t(), tok, up)
    fn.__name__ = head.__name__
    return fn


def lm_inputs(dtype, head):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) / H**0.5 * 4).to(dtype)
    tok = torch.randint(0, V, (T,), generator=g)
    tok[::5] = -100
    return [h, w, tok if head is cross_entropy else tok.clamp(min=0)]


# a small budget: several row chunks and vocabulary blocks, neither dividing T or V
SMALL_BUDGET = {"chunk_budget_mib": 0.05}
