"""The lm_head's logits over row chunks with the weight reordered once a loop
(``fx_passes/kernels/chunk_gemm.py``): on a CPU with oneDNN's bf16 kernels each chunk
equals the graph's op bit for bit, the row-local loss's forward and the five-GEMM call's
row sweep reorder the weight once each (profiler-recorded) and stay as accurate as stock,
and nothing is reordered where the step makes no ``[V, H]`` gradient (a frozen weight),
for another dtype or for a loop of few chunks.
"""

from __future__ import annotations

import pytest
import torch

from fx_passes.kernels.chunk_gemm import MIN_CHUNKS, logits, reorders, row_chunk_logits
from fx_passes.kernels.tiling import even_splits
from fx_passes.testing.gemms import full_gemms, recording
from tests import row_local_cases as rl
from tests import sweep_cases as sweeps
from tests.numerics import run

BF16 = torch.bfloat16
SMALL = {"chunk_budget_mib": 0.03125}  # (4-row chunks of the suite's V 1024: T 64 in 16 chunks)
REORDER, CHUNK_GEMM = "mkldnn::_reorder_linear_weight", "mkldnn::_linear_pointwise"


def _onednn_bf16() -> bool:
    return reorders(torch.empty(8, 8, dtype=BF16), None, MIN_CHUNKS)


needs_onednn = pytest.mark.skipif(not _onednn_bf16(), reason="no oneDNN bf16 kernels on this CPU")


@needs_onednn
@pytest.mark.parametrize("how,with_bias", [("linear", False), ("linear", True), ("matmul", False)])
@pytest.mark.parametrize("n,hidden,vocab,rows", [(512, 64, 1000, 32), (2048, 1024, 4096, 128),
                                                 (1024, 96, 999, 64), (2017, 64, 1000, 126)])
def test_each_chunk_equals_the_op(how, with_bias, n, hidden, vocab, rows):
    """(Chunks of one size, and of two: 2017 rows in 17 chunks of 118 and 119.)"""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=g).to(BF16)
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(BF16)
    b = (torch.randn(vocab, generator=g) / 4).to(BF16) if with_bias else None
    spans = even_splits(n, rows)
    assert len(spans) >= MIN_CHUNKS
    chunk = row_chunk_logits(w, b, how, spans)
    for a, c in spans:
        assert torch.equal(chunk(h[a:c]), logits(h[a:c], w, b, how)), (a, c)


def test_where_it_does_not_reorder():
    w = torch.empty(16, 8, dtype=BF16)
    assert not reorders(w.float(), None, MIN_CHUNKS) and not reorders(w.half(), None, MIN_CHUNKS)
    assert not reorders(w, None, MIN_CHUNKS - 1)
    assert not reorders(w.t(), None, MIN_CHUNKS)  # (a transposed weight: not the layout it reorders)
    h = torch.randn(4, 8).to(BF16)
    w = torch.randn(16, 8).to(BF16)
    for allowed, chunks in ((False, MIN_CHUNKS), (True, 1)):
        got = row_chunk_logits(w, None, "matmul", [(0, 4)] * chunks, allowed)(h)
        assert torch.equal(got, h @ w.t())


def _events(fn, inputs, grad_pos, **options) -> tuple[dict, list]:
    from torch.profiler import profile

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="chunked_logits", options=options)
    run(compiled, inputs, grad_pos)
    with profile() as prof:
        got = run(compiled, inputs, grad_pos)
    names = [e.name for e in prof.events()]
    return {n: names.count(n) for n in (REORDER, CHUNK_GEMM)}, got


@needs_onednn
@pytest.mark.parametrize("name,options,calls", [
    ("forward_kl", {}, 16),  # the loss's forward: 16 chunks
    ("forward_kl", {"gradients_in_forward": False}, 16),  # the five-GEMM call's row sweep
])
def test_a_loop_reorders_the_weight_once_and_stays_accurate(name, options, calls):
    fn, inputs, grad_pos = sweeps.case(name)
    count, ours = _events(fn, inputs, grad_pos, **SMALL, **options)
    assert count == {REORDER: 1, CHUNK_GEMM: calls}, count
    with recording() as gemms:  # (the GEMM recorder counts the reordered chunks: the forward's logits)
        run(torch.compile(fn, backend="chunked_logits", options={**SMALL, **options}), inputs, grad_pos)
    chunks = [g for g in gemms if g.op.startswith("mkldnn._linear_pointwise")]
    assert len(chunks) == calls and full_gemms(chunks, sweeps.T, sweeps.H, sweeps.V, in_dtype=BF16) == 1
    rl.check(fn, inputs, grad_pos, BF16, 2e-6, 2**-8, **SMALL, **options)


@needs_onednn
def test_a_frozen_weight_is_not_reordered():
    """Without ``grad_weight`` the step holds no ``[V, H]`` tensor the reordered copy
    would stand in for: each chunk runs the op."""
    fn, inputs, _ = sweeps.case("forward_kl")
    count, _ = _events(fn, inputs, (0,), **SMALL)
    assert count == {REORDER: 0, CHUNK_GEMM: 0}, count


def test_a_reorder_that_raises_runs_the_op_and_says_so(monkeypatch, caplog):
    from fx_passes.kernels import chunk_gemm

    def refuse(*args):
        raise RuntimeError("no reorder here")

    monkeypatch.setattr(chunk_gemm, "reorders", lambda *args: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    h, w = torch.randn(8, 16).to(BF16), torch.randn(32, 16).to(BF16)
    got = chunk_gemm.row_chunk_logits(w, None, "matmul", [(0, 2)] * MIN_CHUNKS)(h)
    assert torch.equal(got, h @ w.t())
    assert "could not be reordered" in caplog.text and "no reorder here" in caplog.text
