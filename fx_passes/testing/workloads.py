"""The benchmark workloads (W1-W5, W4L, WV, WD, WP, U1-U3), shared by the tests and the benchmarks.

Each workload is a plain function of tensors plus a factory for its inputs, so a
test can run it at toy size and a benchmark at full size with the same code.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

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


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    fn: Callable
    train: bool
    make: Callable  # (T, V, dtype, seed) -> tuple of inputs
    full_size: tuple[int, int]  # (T, V) of the full-size benchmark
    grad_inputs: tuple[int, ...] = ()  # positions of inputs that get gradients
    upgrade: bool = False  # rewritten only with Config(upgrade_low_precision=True)


def _logits(T, V, dtype, g, requires_grad=False):
    # randn * 3 gives a realistic spread of log-probs (about -25 .. 0).
    x = (torch.randn(T, V, generator=g) * 3).to(dtype)
    return x.requires_grad_(requires_grad)


def _make_scoring(T, V, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return _logits(T, V, dtype, g), torch.randint(0, V, (T,), generator=g)


def _make_policy(T, V, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (_logits(T, V, dtype, g, True), torch.randint(0, V, (T,), generator=g),
            torch.randn(T, generator=g))


def _make_lm_head(T, V, dtype=torch.bfloat16, seed=0, H=1024):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype).requires_grad_(True)
    return hidden, weight, torch.randint(0, V, (T,), generator=g), torch.randn(T, generator=g)


def _make_ce(T, V, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[torch.rand(T, generator=g) < 0.1] = -100
    return _logits(T, V, dtype, g, True), labels


def _make_lm_head_ce(T, V, dtype=torch.bfloat16, seed=0, H=1024):
    hidden, weight, labels, _ = _make_lm_head(T, V, dtype, seed, H)
    g = torch.Generator().manual_seed(seed + 1)
    labels[torch.rand(T, generator=g) < 0.1] = -100
    return hidden, weight, labels


# (fraction of the rows a loss leaves out, "prompt" (the first rows of each sequence) or
# "padding" (the last)) of the masked workloads W4C, W4M, W4E, W4S, WDM and WDE; ``set_mask`` changes it.
MASK = {"fraction": 0.5, "style": "prompt"}
SEQUENCE = 1024  # rows per sequence of the masked workloads


def set_mask(fraction: float, style: str) -> None:
    if not 0 <= fraction <= 1 or style not in ("prompt", "padding"):
        raise ValueError(f"mask fraction in [0, 1] and style 'prompt' or 'padding', got {fraction}, "
                         f"{style!r}")
    MASK.update(fraction=fraction, style=style)


def row_mask(T: int) -> torch.Tensor:
    """True for the rows the loss reads: each sequence of ``SEQUENCE`` rows leaves out its
    first (prompt) or last (padding) ``MASK["fraction"]``."""
    pos = torch.arange(T) % min(SEQUENCE, T)
    cut = round(MASK["fraction"] * min(SEQUENCE, T))
    return pos >= cut if MASK["style"] == "prompt" else pos < min(SEQUENCE, T) - cut


def _make_masked_ce(T, V, dtype=torch.bfloat16, seed=0, H=1024):
    hidden, weight, labels, _ = _make_lm_head(T, V, dtype, seed, H)
    return hidden, weight, torch.where(row_mask(T), labels, -100)


def _make_masked_policy(T, V, dtype=torch.bfloat16, seed=0, H=1024):
    return (*_make_lm_head(T, V, dtype, seed, H), row_mask(T).float())


def _make_distillation(T, V, dtype=torch.bfloat16, seed=0, H=1024):
    hidden, weight, _, _ = _make_lm_head(T, V, dtype, seed, H)
    g = torch.Generator().manual_seed(seed + 1)
    return hidden, weight, (hidden.detach().float() @ weight.detach().float().T
                            + torch.randn(T, V, generator=g)).to(dtype)


def _make_masked_distillation(T, V, dtype=torch.bfloat16, seed=0, H=1024):
    return (*_make_distillation(T, V, dtype, seed, H), row_mask(T).float())


def _make_top_p_policy(T, V, dtype=torch.bfloat16, seed=0):
    """Logits and tokens every filter keeps (each row's most likely token)."""
    x, _, advantages = _make_policy(T, V, dtype, seed)
    tokens = x.detach().float().argmax(dim=-1)
    return x, tokens, advantages


def _make_teacher(T, V, dtype=torch.bfloat16, seed=0):
    x, _, _ = _make_policy(T, V, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    return x, (x.detach().float() + torch.randn(T, V, generator=g)).to(dtype)


def _make_weighted_ce(T, V, dtype=torch.bfloat16, seed=0):
    x, labels = _make_ce(T, V, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    return x, labels, torch.rand(V, generator=g) + 0.5


def _make_batched_scoring(T, V, dtype=torch.bfloat16, seed=0, B=4):
    """[B, T/B, V] logits (T = 4096 gives [4, 1024, 32000])."""
    g = torch.Generator().manual_seed(seed)
    S = max(T // B, 1)
    x = (torch.randn(B, S, V, generator=g) * 3).to(dtype)
    return x, torch.randint(0, V, (B, S), generator=g)


def _make_batched_policy(T, V, dtype=torch.bfloat16, seed=0, B=4):
    x, tokens = _make_batched_scoring(T, V, dtype, seed, B)
    g = torch.Generator().manual_seed(seed + 1)
    return x.requires_grad_(True), tokens, torch.randn(tokens.shape, generator=g)


WORKLOADS = {
    "W1": Workload("W1", w1_logprob, False, _make_scoring, (4096, 32768)),
    "W2": Workload("W2", w2_logprob_entropy, False, _make_scoring, (4096, 32768)),
    "W3": Workload("W3", w3_policy_loss, True, _make_policy, (2048, 32768), (0,)),
    "W4": Workload("W4", w4_lm_head_loss, True, _make_lm_head, (4096, 32768), (0, 1)),
    "W5": Workload("W5", w5_cross_entropy, True, _make_ce, (4096, 32768), (0,)),
}

# Benchmarked besides W1-W5: W4 at long T, the upgrade workloads, the large vocabulary of
# the GPU check (Qwen3-0.6B's lm_head, H 1024, V 151936) and the row-local losses
# (distillation, top-p log-probs).
EXTRA_WORKLOADS = {
    "W4L": Workload("W4L", w4_lm_head_loss, True, _make_lm_head, (16384, 32768), (0, 1)),
    "WV": Workload("WV", wv_lm_head_cross_entropy, True, _make_lm_head_ce, (4096, 151936), (0, 1)),
    # W4's shape with a share of the rows left out of the loss (MASK, benchmarks/run.py --mask):
    # cross-entropy with labels -100 (SFT prompts) and the policy loss as a masked mean
    "W4C": Workload("W4C", wv_lm_head_cross_entropy, True, _make_masked_ce, (4096, 32768), (0, 1)),
    "W4M": Workload("W4M", w4m_masked_policy_loss, True, _make_masked_policy, (4096, 32768), (0, 1)),
    "W4E": Workload("W4E", w4e_masked_policy_metrics, True, _make_masked_policy, (4096, 32768), (0, 1)),
    # W4C's cross-entropy label-smoothed: the row-local engine's rows that count
    "W4S": Workload("W4S", w4s_smoothed_cross_entropy, True, _make_masked_ce, (4096, 32768), (0, 1)),
    "WD": Workload("WD", wd_distillation, True, _make_distillation, (4096, 32768), (0, 1)),
    # WD with a share of the rows out of the loss (MASK): the row-local engine's rows that count
    "WDM": Workload("WDM", wdm_masked_distillation, True, _make_masked_distillation, (4096, 32768), (0, 1)),
    # WDM with its masked per-token KL returned too: a row-local call that keeps its results
    "WDE": Workload("WDE", wde_masked_distillation_metrics, True, _make_masked_distillation, (4096, 32768),
                    (0, 1)),
    "WP": Workload("WP", wp_top_p_policy_loss, True, _make_top_p_policy, (4096, 32768), (0,)),
    # the row-local losses' memory table (docs/how-it-works.md 1b): W3's size
    **{name: Workload(name, fn, True, make, (2048, 32768), (0,)) for name, fn, make in (
        ("R1", r1_top_k_policy_loss, _make_top_p_policy), ("R2", r2_min_p_policy_loss, _make_top_p_policy),
        ("R3", r3_forward_kl, _make_teacher), ("R4", r4_jsd, _make_teacher), ("R5", r5_kl_div, _make_teacher),
        ("R6", r6_ce_smoothing_weights, _make_weighted_ce))},
    "U1": Workload("U1", u1_bf16_logprob, False, _make_batched_scoring, (4096, 32000), upgrade=True),
    "U2": Workload("U2", u2_bf16_logprob_entropy_per_sequence, False, _make_batched_scoring,
                   (4096, 32000), upgrade=True),
    "U3": Workload("U3", u3_bf16_policy_loss, True, _make_batched_policy, (4096, 32000), (0,),
                   upgrade=True),
}
ALL_WORKLOADS = {**WORKLOADS, **EXTRA_WORKLOADS}


def on_device(inputs: tuple, device) -> tuple:
    """``inputs`` (built on the CPU, where the seeded generators live) moved to ``device``,
    keeping which of them require grad: the same numbers on every device."""
    def move(x):
        if not x.is_floating_point():
            return x.to(device)
        return x.detach().to(device).requires_grad_(x.requires_grad)
    return tuple(move(x) for x in inputs)


def run_step(workload: Workload, fn: Callable, inputs: tuple):
    """One step: outputs (as a tuple) and, for training, the input gradients."""
    for i in workload.grad_inputs:
        inputs[i].grad = None
    if workload.train:  # (the loss first when several values leave the step: W4E's metric)
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        outs[0].backward()
        return tuple(o.detach() for o in outs), tuple(inputs[i].grad for i in workload.grad_inputs)
    with torch.no_grad():
        out = fn(*inputs)
    return (out if isinstance(out, tuple) else (out,)), ()


class UpcastToFp64(TorchFunctionMode):
    """Turns the workloads' ``.float()`` upcasts into ``.double()`` (FP64 reference)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            return args[0].double()
        if func is torch.Tensor.to and torch.float32 in (*args[1:], kwargs.get("dtype")):
            return args[0].double()
        return func(*args, **kwargs)


def ensure_backend() -> None:
    """Register ``backend="chunked_logits"`` when the package is importable but not
    installed (``PYTHONPATH=.`` on a machine without ``pip install``): the name
    normally comes from the package's entry point."""
    from torch._dynamo.backends.registry import lookup_backend, register_backend
    from torch._dynamo.exc import InvalidBackend

    from fx_passes.entry.backend import chunked_logits
    try:
        lookup_backend("chunked_logits")
    except InvalidBackend:
        register_backend(chunked_logits, name="chunked_logits")
