"""The benchmark workloads (W1-W5, W4L, WV, WD, WP, U1-U3), shared by the tests and the benchmarks.

Each workload is a plain function of tensors (``workload_functions.py``) plus a factory for
its inputs, so a test can run it at toy size and a benchmark at full size with the same code.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from fx_passes.testing.workload_functions import (
    r1_top_k_policy_loss,
    r2_min_p_policy_loss,
    r3_forward_kl,
    r4_jsd,
    r5_kl_div,
    r6_ce_smoothing_weights,
    u1_bf16_logprob,
    u2_bf16_logprob_entropy_per_sequence,
    u3_bf16_policy_loss,
    w1_logprob,
    w2_logprob_entropy,
    w3_policy_loss,
    w4_lm_head_loss,
    w4e_masked_policy_metrics,
    w4m_masked_policy_loss,
    w4s_smoothed_cross_entropy,
    w5_cross_entropy,
    wd_distillation,
    wde_masked_distillation_metrics,
    wdm_masked_distillation,
    wp_top_p_policy_loss,
    wv_lm_head_cross_entropy,
)


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
