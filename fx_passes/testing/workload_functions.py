"""What each benchmark workload computes (W1-W5, WV, W4M, W4E, WD, W4S, WDM, WDE, WP, R1-R6,
U1-U3): a plain function of tensors, the user code the pass compiles.  ``workloads.py``
pairs each with a factory for its inputs and its full size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["TEMPERATURE", "TOP_K", "TOP_P", "w1_logprob", "w2_logprob_entropy", "w3_policy_loss",
           "w4_lm_head_loss", "w5_cross_entropy", "wv_lm_head_cross_entropy", "w4m_masked_policy_loss",
           "w4e_masked_policy_metrics", "wd_distillation", "w4s_smoothed_cross_entropy",
           "wdm_masked_distillation", "wde_masked_distillation_metrics", "wp_top_p_policy_loss",
           "r1_top_k_policy_loss", "r2_min_p_policy_loss", "r3_forward_kl", "r4_jsd", "r5_kl_div",
           "r6_ce_smoothing_weights", "u1_bf16_logprob", "u2_bf16_logprob_entropy_per_sequence",
           "u3_bf16_policy_loss"]


TEMPERATURE = 0.7


def w1_logprob(logits, tokens):
    """Scoring: per-token log-probs of sampled tokens (PPO/GRPO)."""
    logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def w2_logprob_entropy(logits, tokens):
    """Scoring: log-probs and entropy sharing one upcast."""
    z = logits.float() / TEMPERATURE
    logp = torch.log_softmax(z, dim=-1)
    entropy = -(torch.softmax(z, dim=-1) * logp).sum(-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropy


def w3_policy_loss(logits, tokens, advantages):
    """Training: policy-gradient loss on token log-probs."""
    logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    logprob = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return -(logprob * advantages).mean()


def w4_lm_head_loss(hidden, weight, tokens, advantages):
    """Training: logits from the lm_head matmul in the same graph, temperature 1."""
    logits = hidden @ weight.T
    logp = torch.log_softmax(logits.float() / 1.0, dim=-1)
    logprob = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return -(logprob * advantages).mean()


def w5_cross_entropy(logits, labels):
    """Training: SFT cross-entropy with ignored labels."""
    return F.cross_entropy(logits.float(), labels, ignore_index=-100)


def wv_lm_head_cross_entropy(hidden, weight, labels):
    """Training: SFT cross-entropy with the lm_head in the graph (what fused linear
    cross-entropy kernels such as Liger's and Cut Cross-Entropy replace)."""
    return F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100)


def w4m_masked_policy_loss(hidden, weight, tokens, advantages, mask):
    """Training: W4's policy loss as a masked mean (padding / prompt rows weigh 0)."""
    logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
    logprob = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return -(logprob * advantages * mask).sum() / mask.sum()


def w4e_masked_policy_metrics(hidden, weight, tokens, advantages, mask):
    """Training: W4M's loss with an entropy bonus, and verl's masked-mean entropy metric
    returned too (two values leave the graph: the lm_head call keeps per-token results)."""
    logp = torch.log_softmax((hidden @ weight.T).float() / TEMPERATURE, dim=-1)
    logprob = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    loss = ((-(logprob * advantages) - 1e-3 * entropy) * mask).sum() / mask.sum()
    return loss, (entropy.detach() * mask).sum() / mask.sum()


def wd_distillation(hidden, weight, teacher_logits):
    """Training: distillation, forward KL(teacher || student) per token, mean over tokens;
    the student's lm_head in the graph, the teacher's bf16 logits given."""
    s = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
    t = torch.log_softmax(teacher_logits.float(), dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean()


def w4s_smoothed_cross_entropy(hidden, weight, labels):
    """Training: SFT cross-entropy with label smoothing 0.1 over the labels not ignored (the
    row-local engine's: the hand-derived path declines label smoothing)."""
    return F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100, label_smoothing=0.1)


def wdm_masked_distillation(hidden, weight, teacher_logits, mask):
    """Training: WD's forward KL as a masked mean over the rows (prompt / padding rows weigh 0)."""
    s = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
    t = torch.log_softmax(teacher_logits.float(), dim=-1)
    return ((t.exp() * (t - s)).sum(-1) * mask).sum() / mask.sum()


def wde_masked_distillation_metrics(hidden, weight, teacher_logits, mask):
    """Training: WDM's masked-mean KL, and its masked per-token values returned for logging
    (two values leave the graph: the row-local call keeps its per-row results)."""
    s = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
    t = torch.log_softmax(teacher_logits.float(), dim=-1)
    kl = (t.exp() * (t - s)).sum(-1) * mask
    return kl.sum() / mask.sum(), kl.detach()


TOP_K, TOP_P = 50, 0.9


def wp_top_p_policy_loss(logits, tokens, advantages):
    """Training: policy-gradient loss on log-probs over the sampler's support: temperature,
    then top-k, then top-p, renormalised over the kept tokens."""
    z = logits.float() / TEMPERATURE
    kth = z.topk(TOP_K, dim=-1).values[..., -1, None]
    z = z.masked_fill(z < kth, float("-inf"))
    sorted_p, order = z.softmax(-1).sort(dim=-1, descending=True)
    drop = (sorted_p.cumsum(-1) - sorted_p) > TOP_P
    z = z.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    logprob = torch.log_softmax(z, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return -(logprob * advantages).mean()


def _kept(z, k=0, min_p=0.0):
    if k:
        z = z.masked_fill(z < z.topk(k, dim=-1).values[..., -1, None], float("-inf"))
    if min_p:
        probs = z.softmax(-1)
        z = z.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return z


def r1_top_k_policy_loss(logits, tokens, advantages):
    """Row-local: policy loss on top-k (k 50) renormalised log-probs."""
    logp = torch.log_softmax(_kept(logits.float() / TEMPERATURE, k=TOP_K), -1)
    return -(logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) * advantages).mean()


def r2_min_p_policy_loss(logits, tokens, advantages):
    """Row-local: policy loss on min-p (0.05) renormalised log-probs."""
    logp = torch.log_softmax(_kept(logits.float() / TEMPERATURE, min_p=0.05), -1)
    return -(logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) * advantages).mean()


def r3_forward_kl(logits, teacher_logits):
    """Row-local: forward KL(teacher || student), the teacher's bf16 logits given."""
    s, t = torch.log_softmax(logits.float(), -1), torch.log_softmax(teacher_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


def r4_jsd(logits, teacher_logits, beta=0.5):
    """Row-local: generalised JSD (beta 0.5), the mixture in log space."""
    s, t = torch.log_softmax(logits.float(), -1), torch.log_softmax(teacher_logits.float(), -1)
    m = torch.logaddexp(s + math.log(1 - beta), t + math.log(beta))
    return (beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)).mean()


def r5_kl_div(logits, teacher_logits):
    """Row-local: F.kl_div with log-prob targets, batchmean."""
    return F.kl_div(torch.log_softmax(logits.float(), -1), torch.log_softmax(teacher_logits.float(), -1),
                    reduction="batchmean", log_target=True)


def r6_ce_smoothing_weights(logits, labels, weight):
    """Row-local: cross-entropy with label smoothing 0.1 and class weights."""
    return F.cross_entropy(logits.float(), labels, weight=weight, label_smoothing=0.1)


# --- the opt-in FP32 upgrade (Config.upgrade_low_precision): graphs that never upcast ---

def u1_bf16_logprob(logits, tokens):
    """What several RL trainers do to save memory: temperature and log_softmax in model precision."""
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def u2_bf16_logprob_entropy_per_sequence(logits, tokens):
    """The same with entropy, one sequence of the batch at a time (to bound memory)."""
    logprobs, entropies = [], []
    for i in range(logits.shape[0]):
        logp = torch.log_softmax(logits[i] / TEMPERATURE, dim=-1)
        logprobs.append(logp.gather(-1, tokens[i].unsqueeze(-1)).squeeze(-1))
        entropies.append(-(logp.exp() * logp).sum(-1))
    return torch.stack(logprobs), torch.stack(entropies)


def u3_bf16_policy_loss(logits, tokens, advantages):
    """Training on the model-precision log-probs."""
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    logprob = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return -(logprob * advantages).mean()
