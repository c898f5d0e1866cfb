"""``lm_head_plan="kept_logits"`` (NOTE [kept logits], ``kernels/log_softmax/lm_head_kept.py``):
the per-token forward keeps its model-precision logits and the backward reads them, so a
step runs three ``[T, H] x [H, V]`` GEMMs, not the recomputing plans' four.  Run on this CPU
with the test-only ``out_dtype`` kernels (``fx_passes.testing.gemms``); the numerics against
FP64 and stock: ``tests/test_lm_head.py::test_gpu_plan_numerics_no_worse_than_stock``."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from fx_passes.kernels import tiling
from fx_passes.reporting.report import say_once
from fx_passes.testing.gemms import cpu_out_dtype_kernels, full_gemms, recording, tracing

T, H, V = 256, 64, 1024
F32, BF16 = torch.float32, torch.bfloat16
CPU = torch.device("cpu")


def per_token(hidden, weight, tokens):
    """Per-token log-probs and entropy, as a policy loss reads them (they leave the graph)."""
    logp = torch.log_softmax((hidden @ weight.T).float() / 0.7, -1)
    return logp.gather(-1, tokens[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def returns_logits(hidden, weight, tokens):
    logits = hidden @ weight.T
    logp = torch.log_softmax(logits.float(), -1)
    return logp.gather(-1, tokens[:, None]).squeeze(-1), logits


def _inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g).to(BF16)
    w = (torch.randn(V, H, generator=g) / H**0.5).to(BF16)
    return h, w, torch.randint(0, V, (T,), generator=g), torch.randn(T, generator=g)


def _grads(fn, h, w, tokens, weights, retain=False):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    out = fn(h, w, tokens)
    loss = (out[0] * weights).sum() + (out[1].sum() if out[1] is not None and out[1].dtype == F32 else 0)
    loss.backward(retain_graph=retain)
    grads = (h.grad.clone(), w.grad.clone())
    if retain:  # the same graph's backward again: the kept logits were only read
        h.grad, w.grad = None, None
        loss.backward()
        assert torch.equal(h.grad, grads[0]) and torch.equal(w.grad, grads[1])
    return grads


@pytest.fixture(scope="module")
def kept_step():
    """(the ATen calls, the GEMMs) of a step of ``per_token`` with the kept logits."""
    h, w, tokens, weights = _inputs()
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(per_token, backend="chunked_logits", options={"lm_head_plan": "kept_logits"})
    with cpu_out_dtype_kernels():
        _grads(fn, h, w, tokens, weights, retain=True)  # compiles; a retained graph's two backwards agree
        with tracing() as ops:
            _grads(fn, h, w, tokens, weights)
        with recording() as gemms:
            _grads(fn, h, w, tokens, weights)
    assert counters["chunked_logits"]["lm_head_fused"] == 1, dict(counters["chunked_logits"])
    return ops, gemms


def test_three_gemms_a_step(kept_step):
    _, gemms = kept_step
    assert full_gemms(gemms, T, H, V) == pytest.approx(3.0)  # the recomputing plans: 4
    assert all(g.in_dtype == BF16 for g in gemms)


def test_the_backward_reads_the_kept_logits_chunk_by_chunk(kept_step):
    ops, _ = kept_step
    names = [o.op for o in ops]
    assert "chunked_logits.lm_head_stats_kept.default" in names
    backward = ops[names.index("chunked_logits.lm_head_stats_kept.default") + 1:]
    gemms = [(o.op, o.shape, o.dtype) for o in backward if o.op.startswith(("aten.mm", "aten.addmm"))]
    rows = T // tiling.MAX_LOSS_CHUNKS  # the device's budget: 2 chunks
    first = [("aten.mm.out", (rows, H), BF16),        # grad_hidden[chunk] = g @ W, rounded once
             ("aten.mm.dtype_out", (V, H), F32)]      # grad_weight's FP32 sum written: no zero-fill
    later = [first[0], ("aten.addmm.dtype_out", (V, H), F32)]  # added to inside the GEMM
    assert gemms == first + later * (tiling.MAX_LOSS_CHUNKS - 1)  # no logits GEMM: none recomputed
    # no FP32 [T, V] tensor anywhere in the step; the largest FP32 one is the [V, H] sum
    assert max(torch.Size(o.shape).numel() for o in ops if o.dtype == F32) == V * H


def test_logits_the_graph_returns_are_not_kept():
    """The caller may change returned logits in place (TRL divides them by the temperature):
    the loop that writes them recomputes in its backward, as without the plan."""
    h, w, tokens, weights = _inputs()
    torch._dynamo.reset()
    fn = torch.compile(returns_logits, backend="chunked_logits", options={"lm_head_plan": "kept_logits"})
    with cpu_out_dtype_kernels():
        with tracing() as ops:
            got = _grads(fn, h, w, tokens, weights)
    names = {o.op for o in ops}
    assert "chunked_logits.lm_head_stats_logits.default" in names
    assert "chunked_logits.lm_head_stats_kept.default" not in names
    want = _grads(torch.compile(returns_logits, backend="inductor"), h, w, tokens, weights)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_a_graph_without_a_backward_keeps_nothing():
    """Scoring under ``no_grad`` (a reference model's log-probs): no backward reads the
    logits, so the loop keeps none (the recomputing plan's forward)."""
    h, w, tokens, _ = _inputs()
    torch._dynamo.reset()
    fn = torch.compile(per_token, backend="chunked_logits", options={"lm_head_plan": "kept_logits"})
    with cpu_out_dtype_kernels(), torch.no_grad(), tracing() as ops:
        got = fn(h, w, tokens)
    names = {o.op for o in ops}
    assert "chunked_logits.lm_head_stats.default" in names
    assert "chunked_logits.lm_head_stats_kept.default" not in names
    assert not [o for o in ops if o.dtype == BF16 and torch.Size(o.shape).numel() >= T * V]  # no [T, V]
    torch.testing.assert_close(got[0], per_token(h, w, tokens)[0], atol=2e-2, rtol=2e-2)


def test_without_out_dtype_gemms_the_devices_own_plan_runs_and_says_so(caplog):
    say_once.cache_clear()  # (said once a process)
    with caplog.at_level(logging.INFO, logger="fx_passes"):
        plan = tiling.backward_plan(CPU, BF16, "kept_logits")
    assert plan == tiling.backward_plan(CPU, BF16, "auto") != "kept_logits"
    assert "lm_head_plan 'kept_logits' needs aten::mm.dtype on cpu" in caplog.text
    assert "the backward runs the device's own plan (as lm_head_plan='auto')" in caplog.text
    with cpu_out_dtype_kernels():
        assert tiling.backward_plan(CPU, BF16, "kept_logits") == "kept_logits"
        assert tiling.backward_plan(CPU, BF16, "auto") != "kept_logits"  # auto never picks it


@pytest.mark.parametrize("rows, stock_fp32, kept", [
    (8192, True, True),     # W4L-tok at the H200 run's size: under stock's FP32 [T, V]
    (8192, False, False),   # WV-tok (a cross-entropy alone): the FP32 [V, H] sum is over stock's peak
    (256, True, False),     # short rows: the [V, H] sum is more than stock's [T, V]
    (None, True, False),    # T not known at compile time: not proven, not kept
])
def test_kept_only_where_the_peak_stays_under_stocks(rows, stock_fp32, kept):
    assert tiling.holds_kept_logits(rows, 151936, 4096, stock_fp32) is kept
    if rows is not None:
        ours, stock = tiling.kept_logits_peaks(rows, 151936, 4096, stock_fp32)
        assert (ours <= stock) is kept


def per_token_ce(hidden, weight, labels):
    return torch.nn.functional.cross_entropy((hidden @ weight.T).float(), labels, reduction="none"), None


def test_a_cross_entropy_alone_runs_gpu_and_says_why(caplog):
    """Stock's cross-entropy keeps no FP32 [T, V]: keeping the logits with the FP32 [V, H]
    sum would peak above it, so the call runs "gpu" (logged, counted)."""
    h, w, tokens, weights = _inputs()
    torch._dynamo.reset()
    counters.clear()
    say_once.cache_clear()
    fn = torch.compile(per_token_ce, backend="chunked_logits", options={"lm_head_plan": "kept_logits"})
    with cpu_out_dtype_kernels(), caplog.at_level(logging.INFO, logger="fx_passes"):
        with tracing() as ops:
            got = _grads(fn, h, w, tokens, weights)
    assert counters["chunked_logits"]["kept_logits_over_stock"] == 1, dict(counters["chunked_logits"])
    assert "lm_head_plan 'kept_logits' would keep the logits at a peak of" in caplog.text
    assert "chunked_logits.lm_head_stats_kept.default" not in {o.op for o in ops}
    want = _grads(torch.compile(per_token_ce, backend="inductor"), h, w, tokens, weights)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
