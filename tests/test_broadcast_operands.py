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

from tests.grpo_losses import GRAD, B, S, compare, inputs, logps, padding_skipped, per_token_loss
from tests.helpers import chunked_counters, ops, rewrite_graphs
from tests.numerics import F32, TOLERANCES, assert_no_less_accurate, reference, run

BF16, FP16 = TOLERANCES


def bnpo(hidden, weight, tokens, old, adv, mask, up=F32):
    loss = per_token_loss(hidden, weight, tokens, old, adv, up)
    return (loss * mask.to(up)).sum() / mask.to(up).sum().clamp(min=1.0)


def dr_grpo(hidden, weight, tokens, old, adv, mask, up=F32):
    loss = per_token_loss(hidden, weight, tokens, old, adv, up)
    return (loss * mask.to(up)).sum() / (loss.size(0) * S)


def dapo(hidden, weight, tokens, old, adv, mask, up=F32):
    loss = per_token_loss(hidden, weight, tokens, old, adv, up)
    return (loss * mask.to(up)).sum() / 37.0  # (num_items_in_batch / num_processes)


def position_weights(hidden, weight, tokens, old, adv, mask, up=F32):
    """An operand broadcast along the other dim: one weight per position, ``[S]``."""
    w = torch.linspace(0.5, 1.5, S, dtype=up, device=hidden.device)
    m = mask.to(up)
    return -(logps(hidden, weight, tokens, up) * w * adv.to(up)[:, None] * m).sum() / m.sum()


LOSSES = [bnpo, dr_grpo, dapo, position_weights]


@pytest.mark.parametrize("fn", LOSSES, ids=lambda f: f.__name__)
def test_loss_tail_taken_and_masked_rows_skipped(fn):
    data = inputs(torch.bfloat16)
    c = compare(fn, data, BF16, "two_sweeps")
    assert c.get("gradients_in_forward") == 1 and padding_skipped(c, data), c


@pytest.mark.parametrize("tol,plan,dynamic", [(FP16, "two_sweeps", False), (BF16, "gpu", False),
                                              (BF16, "two_sweeps", True)],
                         ids=["fp16", "gpu_plan", "dynamic"])
def test_dtypes_plans_and_dynamic_shapes(tol, plan, dynamic):
    """The ``gpu`` plan (the test-only ``out_dtype`` kernels), fp16, and symbolic sizes:
    the expand's sizes read off the hidden states."""
    data = inputs(tol.values[0])
    c = compare(bnpo, data, tol, plan, dynamic)
    assert c.get("gradients_in_forward") == 1 and padding_skipped(c, data), c


def test_the_operand_is_expanded_to_the_rows_in_the_graph():
    """Each broadcast operand (TRL's two ``adv.unsqueeze(1)``) becomes ``.expand(B, S)``
    before the tail, read by the call; the user's ``unsqueeze`` stays where it was."""
    data = [x.requires_grad_(i in GRAD) for i, x in enumerate(inputs(torch.bfloat16))]
    before, after = rewrite_graphs(bnpo, *data, lm_head_plan="two_sweeps")
    assert ".expand" not in ops(before)
    assert ops(after).count(".unsqueeze .expand") == 2 and ops(after).endswith("lm_head_loss"), ops(after)
    call = next(n for n in after.graph.nodes if "lm_head_loss" in str(n.target))
    expanded = [a for a in call.args if getattr(a, "target", None) == "expand"]
    assert len(expanded) == 2 and all(tuple(e.meta["example_value"].shape) == (B, S) for e in expanded)


def test_an_operand_that_needs_a_gradient_is_still_declined():
    """Only the operand's shape is new: a broadcast advantage that needs a gradient keeps
    the per-token path (the fused op would not give it one), the graph's value unchanged."""
    data, grad = inputs(torch.bfloat16), (0, 1, 4)
    ref = reference(bnpo, data, grad)
    torch._dynamo.reset()
    stock = run(torch.compile(bnpo, backend="inductor"), data, grad)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(bnpo, backend="chunked_logits", options={"lm_head_plan": "two_sweeps"})
    ours = run(compiled, data, grad)
    c = chunked_counters()
    assert c.get("lm_head_fused") == 1 and not c.get("gradients_in_forward"), c
    (ref_adv, stock_adv, ours_adv), tail = (r[1][2] for r in (ref, stock, ours)), slice(0, 2)
    assert_no_less_accurate(*((r[0], r[1][tail]) for r in (ours, stock, ref)), *BF16.values)
    assert (ours_adv - ref_adv).abs().max() <= (stock_adv - ref_adv).abs().max() * 1.01 + 1e-7
