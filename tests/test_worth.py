""""Should it?" (``match/worth.py``): a row-local region that stock Inductor runs with no
``[T, V]`` tensor but the logits' model-precision gradient is left to stock, said in the
counters, the log and the summaries; every other region is still rewritten.

The rule's verdict is checked against the code stock Inductor generates for each program:
left to stock exactly where stock allocates no ``[T, V]`` buffer besides the gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

import fx_passes
from fx_passes.match.worth import LEFT_TO_STOCK
from fx_passes.testing.workloads import EXTRA_WORKLOADS, run_step
from tests import row_local_cases as rl
from tests.codegen import allocations, compiled_codes
from tests.helpers import chunked_counters, made_otherwise_before, rewrite_graphs
from tests.numerics import run


def _stock_holds_rows_by_vocab(codes: list[str], rows: int, vocab: int, n_grads: int) -> list:
    """Stock's buffers of ``rows * vocab`` elements or more, but the ``n_grads`` bf16 gradients."""
    big = [(d, t) for c in codes for d, t in allocations(c)
           if all(x.isdigit() for x in d) and math.prod(map(int, d)) >= rows * vocab]
    bf16 = [b for b in big if b[1] == "torch.bfloat16"]
    return [b for b in big if b[1] != "torch.bfloat16"] + bf16[n_grads:]


def _softmax_entropy(x):
    return -(x.float().softmax(-1) * x.float().log_softmax(-1)).sum(-1).mean()


# left to stock: KL with log-prob targets, label smoothing and class weights, a z-loss,
# flattened [B, S, V] logits; rewritten: a KL of probabilities (xlogy: stock saves an
# FP32 [T, V] tensor), a JSD (logaddexp: two [T, V] masks), an entropy through a softmax
@pytest.mark.sampled
@pytest.mark.parametrize("name", [
    "forward_kl", "ce_smoothing_z_loss", "kl_div_flattened", "kl_div_probs", "jsd",
    pytest.param("softmax_entropy", marks=made_otherwise_before("2.13", "stock keeps no FP32 [T, V] for a "
                                                                "softmax entropy"))])
def test_verdict_agrees_with_stock_inductors_code(name):
    fn, inputs, grad_pos = rl.inputs(name if name != "softmax_entropy" else "forward_kl", torch.bfloat16)
    if name == "softmax_entropy":  # (a softmax: stock writes its exponentials to an FP32 [T, V] buffer)
        fn, inputs = _softmax_entropy, inputs[:1]
    rewrite_graphs(fn, *inputs)
    left = chunked_counters().get("left_to_stock", 0)
    assert left + chunked_counters().get("row_local", 0) == 1, chunked_counters()
    torch._dynamo.reset()
    _, codes = compiled_codes(run, torch.compile(fn, backend="inductor"), inputs, grad_pos)
    held = _stock_holds_rows_by_vocab(codes, rl.T, rl.V, len(grad_pos))
    assert bool(left) == (held == []), (name, held)


@pytest.mark.parametrize("name", ["R5", "R6"])
def test_left_to_stock_reported_with_stocks_results(name):
    w = EXTRA_WORKLOADS[name]
    inputs = w.make(64, 512)
    stock = run_step(w, torch.compile(w.fn, backend="inductor"), inputs)
    torch._dynamo.reset()
    ours = run_step(w, torch.compile(w.fn, backend="chunked_logits"), inputs)
    c = chunked_counters()
    assert c.get("left_to_stock") == 1 and not c.get("rewritten") and not c.get("declined"), c
    for a, b in zip([*stock[0], *stock[1]], [*ours[0], *ours[1]]):
        assert torch.equal(a, b)  # the graph as it was: stock's code
    summary = fx_passes.summary()
    assert summary["regions_left_to_stock"] == 1 and summary["regions_declined"] == 0
    assert summary["left_to_stock"][0]["what"].endswith(LEFT_TO_STOCK)
    assert "1 left to stock Inductor" in fx_passes.summary_text()


def test_report_only_says_left_to_stock_and_the_switch_forces_the_engine():
    fn, inputs, _ = rl.inputs("kl_div_log_target", torch.bfloat16)
    rewrite_graphs(fn, *inputs, report_only=True)
    assert chunked_counters() == {"left_to_stock": 1}
    counters.clear()
    rewrite_graphs(fn, *inputs, leave_to_stock=False)
    assert chunked_counters().get("row_local") == 1 and not chunked_counters().get("left_to_stock")
