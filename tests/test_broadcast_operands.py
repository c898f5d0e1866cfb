"""Per-row operands broadcast to the rows (NOTE [operands broadcast to the rows] in
``fx_passes/match/loss_tail.py``): TRL's GRPO loss as it ships, one advantage per
sequence read as ``advantages.unsqueeze(1)`` by the ``[B, S]`` token log-probs.

Before, the loss tail was declined (``[B, 1]``: "neither one value per row ... nor a 0-d
tensor"): no gradients in the forward, and the rows the completion mask leaves out ran
anyway.  Now the operand is expanded to the rows in the graph and the tail is taken."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from fx_passes.testing.gemms import cpu_out_dtype_kernels
from tests.helpers import chunked_counters, ops, rewrite_graphs
from tests.numerics import F32, TOLERANCES, assert_no_less_accurate, reference, run

B, S, H, V = 4, 24, 32, 512
EPS_LOW, EPS_HIGH = 0.2, 0.28


def _per_token_loss(hidden, weight, tokens, old, adv, up):
    """TRL ``GRPOTrainer._compute_loss`` (token-level importance sampling, no KL term)."""
    logps = torch.log_softmax((hidden @ weight.T).to(up), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    coef_1 = torch.exp(logps - old.to(up))
    coef_2 = torch.clamp(coef_1, 1 - EPS_LOW, 1 + EPS_HIGH)
    return -torch.min(coef_1 * adv.to(up).unsqueeze(1), coef_2 * adv.to(up).unsqueeze(1))


def bnpo(hidden, weight, tokens, old, adv, mask, up=F32):
    loss = _per_token_loss(hidden, weight, tokens, old, adv, up)
    return (loss * mask.to(up)).sum() / mask.to(up).sum().clamp(min=1.0)


def dr_grpo(hidden, weight, tokens, old, adv, mask, up=F32):
    loss = _per_token_loss(hidden, weight, tokens, old, adv, up)
    return (loss * mask.to(up)).sum() / (loss.size(0) * S)


def dapo(hidden, weight, tokens, old, adv, mask, up=F32):
    loss = _per_token_loss(hidden, weight, tokens, old, adv, up)
    return (loss * mask.to(up)).sum() / 37.0  # (num_items_in_batch / num_processes)


def position_weights(hidden, weight, tokens, old, adv, mask, up=F32):
    """An operand broadcast along the other dim: one weight per position, ``[S]``."""
    logps = torch.log_softmax((hidden @ weight.T).to(up), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    w = torch.linspace(0.5, 1.5, S, dtype=up, device=hidden.device)
    return -(logps * w * adv.to(up)[:, None] * mask.to(up)).sum() / mask.to(up).sum()


LOSSES = [bnpo, dr_grpo, dapo, position_weights]
GRAD = (0, 1)


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, S, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 2 / H**0.5).to(dtype)
    tokens = torch.randint(0, V, (B, S), generator=g)
    old = torch.randn(B, S, generator=g) * 0.1 - 6
    adv = torch.randn(B, generator=g)
    mask = torch.ones(B, S, dtype=torch.long)  # (TRL's completion_mask: integer)
    mask[:, S // 2:] = 0  # (each completion's second half is padding: its rows are left out)
    mask[1, 5] = 0
    return [hidden, weight, tokens, old, adv, mask]


def _compare(fn, dtype, out_rtol, grad_rtol, plan, dynamic=False):
    inputs = _inputs(dtype)
    ref = reference(fn, inputs, GRAD)
    torch._dynamo.reset()
    stock = run(torch.compile(fn, backend="inductor", dynamic=dynamic), inputs, GRAD)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="chunked_logits", dynamic=dynamic,
                             options={"lm_head_plan": plan, "chunk_budget_mib": 0.03})
    with cpu_out_dtype_kernels():
        ours = run(compiled, inputs, GRAD)
    assert_no_less_accurate(ours, stock, ref, dtype, out_rtol, grad_rtol)
    return chunked_counters()


@pytest.mark.parametrize("fn", LOSSES, ids=lambda f: f.__name__)
def test_loss_tail_taken_and_masked_rows_skipped(fn):
    c = _compare(fn, *TOLERANCES[0].values, "two_sweeps")
    skipped = B * (S - S // 2) + 1
    assert c.get("gradients_in_forward") == 1 and c.get("rows_skipped") == skipped, c


BF16, FP16 = TOLERANCES


@pytest.mark.parametrize("tol,plan,dynamic", [(FP16, "two_sweeps", False), (BF16, "gpu", False),
                                              (BF16, "two_sweeps", True)],
                         ids=["fp16", "gpu_plan", "dynamic"])
def test_dtypes_plans_and_dynamic_shapes(tol, plan, dynamic):
    """The ``gpu`` plan (the test-only ``out_dtype`` kernels), fp16, and symbolic sizes:
    the expand's sizes read off the hidden states."""
    c = _compare(bnpo, *tol.values, plan, dynamic)
    assert c.get("gradients_in_forward") == 1 and c.get("rows_skipped") == B * (S - S // 2) + 1, c


def test_the_operand_is_expanded_to_the_rows_in_the_graph():
    """Each broadcast operand (TRL's two ``adv.unsqueeze(1)``) becomes ``.expand(B, S)``
    before the tail, read by the call; the user's ``unsqueeze`` stays where it was."""
    inputs = [x.requires_grad_(i in GRAD) for i, x in enumerate(_inputs(torch.bfloat16))]
    before, after = rewrite_graphs(bnpo, *inputs, lm_head_plan="two_sweeps")
    assert ".expand" not in ops(before)
    assert ops(after).count(".unsqueeze .expand") == 2 and ops(after).endswith("lm_head_loss"), ops(after)
    call = next(n for n in after.graph.nodes if "lm_head_loss" in str(n.target))
    expanded = [a for a in call.args if getattr(a, "target", None) == "expand"]
    assert len(expanded) == 2 and all(tuple(e.meta["example_value"].shape) == (B, S) for e in expanded)


def test_an_operand_that_needs_a_gradient_is_still_declined():
    """Only the operand's shape is new: a broadcast advantage that needs a gradient keeps
    the per-token path (the fused op would not give it one), the graph's value unchanged."""
    inputs = _inputs(torch.bfloat16)
    grad = (0, 1, 4)
    ref = reference(bnpo, inputs, grad)
    torch._dynamo.reset()
    stock = run(torch.compile(bnpo, backend="inductor"), inputs, grad)
    torch._dynamo.reset()
    counters.clear()
    ours = run(torch.compile(bnpo, backend="chunked_logits", options={"lm_head_plan": "two_sweeps"}),
               inputs, grad)
    c = chunked_counters()
    assert c.get("lm_head_fused") == 1 and not c.get("gradients_in_forward"), c
    (ref_adv, stock_adv, ours_adv), tail = (r[1][2] for r in (ref, stock, ours)), slice(0, 2)
    assert_no_less_accurate(*((r[0], r[1][tail]) for r in (ours, stock, ref)), *TOLERANCES[0].values)
    assert (ours_adv - ref_adv).abs().max() <= (stock_adv - ref_adv).abs().max() * 1.01 + 1e-7
