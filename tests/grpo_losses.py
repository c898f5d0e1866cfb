"""The GRPO losses of the RL frameworks as they ship them, on ``[B, S]`` token log-probs of
an lm_head in the graph, and their harness (``tests/test_broadcast_operands.py``,
``tests/test_group_sums.py``)."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from fx_passes.testing.gemms import cpu_out_dtype_kernels
from tests.helpers import chunked_counters
from tests.numerics import F32, assert_no_less_accurate, reference, run

B, S, H, V = 4, 24, 32, 512
GRAD = (0, 1)  # (the hidden states' and the lm_head's gradients)


def logps(hidden, weight, tokens, up=F32):
    return torch.log_softmax((hidden @ weight.T).to(up), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def per_token_loss(hidden, weight, tokens, old, adv, up=F32, lp=None):
    """TRL ``GRPOTrainer._compute_loss``'s per-token loss (token-level ratios, no KL term):
    one advantage per sequence, read as ``advantages.unsqueeze(1)``."""
    lp = logps(hidden, weight, tokens, up) if lp is None else lp
    coef_1 = torch.exp(lp - old.to(up))
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.28)
    return -torch.min(coef_1 * adv.to(up).unsqueeze(1), coef_2 * adv.to(up).unsqueeze(1))


def inputs(dtype, padding=None, empty_sequence=False):
    """(hidden, weight, tokens, old log-probs, advantages, mask); ``padding(b)``: where
    sequence ``b``'s padding starts (default: completions of different lengths)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, S, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 2 / H**0.5).to(dtype)
    tokens = torch.randint(0, V, (B, S), generator=g)
    old = torch.randn(B, S, generator=g) * 0.1 - 6
    adv = torch.randn(B, generator=g)
    mask = torch.ones(B, S, dtype=torch.long)  # (TRL's completion_mask, verl's response_mask: integers)
    for b in range(B):
        mask[b, (padding or (lambda b: S // 2 + 3 * b))(b):] = 0
    if empty_sequence:
        mask[2] = 0
    return [hidden, weight, tokens, old, adv, mask]


def compare(fn, data, tol, plan, dynamic=False, grad=GRAD, **options) -> dict:
    """``fn`` compiled by stock Inductor and by chunked_logits (``plan``; a small budget:
    several chunks; ``options``: more of the backend's), ours no further from FP64 than
    stock's (``tol``: a TOLERANCES param); ours's counters."""
    ref = reference(fn, data, grad)
    torch._dynamo.reset()
    stock = run(torch.compile(fn, backend="inductor", dynamic=dynamic), data, grad)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="chunked_logits", dynamic=dynamic,
                             options={"lm_head_plan": plan, "chunk_budget_mib": 0.03, **options})
    with cpu_out_dtype_kernels():
        ours = run(compiled, data, grad)
    assert_no_less_accurate(ours, stock, ref, data[0].dtype, *tol.values[1:])
    return chunked_counters()


def padding_skipped(c: dict, data) -> bool:
    """Every padding row left out (the rows kept rounded up to a multiple of 8: chunks stay
    aligned)."""
    padding = int((data[-1] == 0).sum())
    return c.get("masked_rows") == 1 and padding - 8 < c.get("rows_skipped", 0) <= padding
