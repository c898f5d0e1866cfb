"""The vocab-parallel one-pass loop on the rows a mask keeps
(``fx_passes/distributed/masked_stages.py``): the op, driven by a skip graph written here
(the rewrite builds none yet), in place of ``shard_lm_head_stages`` in a compiled
Megatron-style step on a one-rank gloo group.  Against FP64 and stock: a ``where`` mask and
a multiplicative one, none / half / every row masked, an infinite incoming gradient
(stock's NaN pattern), an infinite hidden state in a masked row (the row runs); the rows
the GEMMs run."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch.fx import Graph, GraphModule

from fx_passes.distributed import one_pass, shard_stages
from fx_passes.distributed.masked_stages import shard_lm_head_stages_masked
from fx_passes.kernels.ops import user_bodies
from tests.numerics import assert_no_less_accurate, reference
from tests.shard_heads import SMALL_BUDGET, T, lm_inputs, logprob

pytestmark = pytest.mark.usefixtures("one_rank_group")  # (conftest)


def _skip_graph(n_results: int, fill: float) -> str:
    """``skip(width, z, mask) -> (mask == 0 & z finite, fill, ..)``: what the rewrite's
    proof would give for ``_step``'s loss (a masked row's values reach it only through the
    mask; its logits finite, every stage's derivatives are bounded).  Each result of a
    skipped row is ``fill``: with 1, the all-reduced sum is the group's size, its ``log``
    finite."""
    g = Graph()
    _, z, mask = g.placeholder("width"), g.placeholder("z"), g.placeholder("mask")
    skip = g.call_function(torch.logical_and, (g.call_function(torch.eq, (mask, 0)),
                                               g.call_function(torch.isfinite, (z,))))
    g.output((skip, *[fill] * n_results))
    return user_bodies.register(GraphModule(torch.nn.Module(), g))


@pytest.fixture
def masked_calls(monkeypatch):
    """Compiles put ``shard_lm_head_stages_masked`` (skip graph :func:`_skip_graph`, the
    step's ``mask`` input) where the rewrite puts ``shard_lm_head_stages``; yields the
    calls made."""
    made, rewrite = [], shard_stages._rewrite_one_pass

    def swapped(graph, *args, **kwargs):
        rewrite(graph, *args, **kwargs)
        (mask,) = [p for p in graph.find_nodes(op="placeholder") if "mask" in p.name]
        for call in graph.find_nodes(op="call_function", target=one_pass.shard_lm_head_stages):
            n_results = len(one_pass.ONE_PASS_PLANS[call.args[0]].outputs)
            call.target = shard_lm_head_stages_masked
            call.kwargs = {"mask_key": _skip_graph(n_results, 1.0), "mask_operands": (mask,)}
            made.append(call.name)
    monkeypatch.setattr(shard_stages, "_rewrite_one_pass", swapped)
    yield made


def _step(where: bool):
    def fn(h, w, tok, mask, up=torch.float32):
        y = logprob(h @ w.t(), tok, up)
        kept = torch.where(mask > 0, y, 0.0) if where else y * mask.to(up)
        return kept.sum() / mask.to(up).sum()
    return fn


def _inputs(dtype, masked: float):
    h, w, tok = lm_inputs(dtype, logprob)
    mask = (torch.rand(T, generator=torch.Generator().manual_seed(1)) >= masked).float()
    return [h, w, tok, mask]


def _run(fn, data, grad_out=1.0):
    """(outputs, gradients of h and w) of ``fn`` on copies of ``data``."""
    h, w = (t.detach().clone().requires_grad_() for t in data[:2])
    out = fn(h, w, *data[2:])
    out.backward(torch.full_like(out, grad_out))
    return [out.detach()], [h.grad, w.grad]


def _compiled(fn, backend, data, grad_out=1.0):
    torch._dynamo.reset()
    counters.clear()
    options = SMALL_BUDGET if backend == "chunked_logits" else None
    return _run(torch.compile(fn, backend=backend, options=options), data, grad_out)


@pytest.mark.parametrize("where", [True, False], ids=["where", "mul"])
@pytest.mark.parametrize("masked,dtype", [(0.5, torch.bfloat16), (0.0, torch.float16), (1.0, torch.bfloat16),
                                          (0.75, torch.float16)])
def test_rows_left_out_give_stocks_results(masked_calls, where, masked, dtype):
    fn, data = _step(where), _inputs(dtype, masked)
    ref = reference(fn, data, (0, 1))
    stock = _compiled(fn, "inductor", data)
    ours = _compiled(fn, "chunked_logits", data)
    assert masked_calls, "the masked op was not emitted"
    c = counters["chunked_logits"]
    expect_skipped = int((data[3] == 0).sum())
    assert c["rows_seen"] == T and T - c["rows_skipped"] >= T - expect_skipped
    if masked:
        assert c["rows_skipped"] > 0
    if masked == 1.0:  # (every row left out: ours is exactly 0/0 as stock's)
        assert torch.isnan(ours[0][0]).item() and torch.isnan(stock[0][0]).item()
        for got, st in zip(ours[1], stock[1]):
            torch.testing.assert_close(got, st, equal_nan=True)
        return
    assert_no_less_accurate(ours, stock, ref, dtype, 2e-2, 2e-2)


def _gemm_areas(monkeypatch, data) -> tuple[int, int]:
    """Rows x columns of the lm_head matmuls a compiled ``_step(True)`` runs on ``data``, in
    the forward and in the backward (real tensors only: not the fake ones tracing uses)."""
    calls, linear = [], torch.nn.functional.linear

    def counted(a, b, *rest):
        if not isinstance(a, torch._subclasses.FakeTensor):
            calls.append(a.shape[0] * b.shape[0])
        return linear(a, b, *rest)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(_step(True), backend="chunked_logits", options=SMALL_BUDGET)
    monkeypatch.setattr(torch.nn.functional, "linear", counted)
    h, w = (t.clone().requires_grad_() for t in data[:2])
    out = step(h, w, *data[2:])
    forward = sum(calls)
    out.backward()
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    return forward, sum(calls) - forward


def test_the_gemms_run_only_the_kept_rows(masked_calls, monkeypatch):
    """Half the rows masked: the forward's and the backward's GEMMs run the kept rows
    (rounded up to whole granules), against every row with no row masked."""
    data = _inputs(torch.bfloat16, 0.5)
    every = _gemm_areas(monkeypatch, [*data[:3], torch.ones(T)])
    masked = _gemm_areas(monkeypatch, data)
    ran = T - counters["chunked_logits"]["rows_skipped"]
    assert int((data[3] != 0).sum()) <= ran < T
    assert masked[0] * T == every[0] * ran and masked[1] * T == every[1] * ran, (masked, every, ran)


@pytest.mark.parametrize("grad_out", [float("inf"), float("nan")])
def test_an_infinite_incoming_gradient_gives_stocks_nan_pattern(masked_calls, grad_out):
    """``y * mask`` with an infinite loss gradient: a masked row's cotangent is ``inf * 0``,
    NaN; the backward runs every row, as stock's."""
    fn, data = _step(False), _inputs(torch.bfloat16, 0.5)
    stock = _compiled(fn, "inductor", data, grad_out)
    ours = _compiled(fn, "chunked_logits", data, grad_out)
    assert counters["chunked_logits"]["rows_skipped"] > 0
    for got, st in zip(ours[1], stock[1]):
        assert torch.equal(got.isnan(), st.isnan()) and torch.equal(got.isinf(), st.isinf())


@pytest.mark.parametrize("where", [True, False], ids=["where", "mul"])
def test_an_infinite_hidden_state_in_a_masked_row_runs_that_row(masked_calls, where):
    fn, data = _step(where), _inputs(torch.bfloat16, 0.5)
    row = int((data[3] == 0).nonzero()[0])
    data[0][row, 3] = float("inf")
    stock = _compiled(fn, "inductor", data)
    ours = _compiled(fn, "chunked_logits", data)
    assert counters["chunked_logits"]["rows_skipped"] > 0
    for got, st in zip(ours[0] + ours[1], stock[0] + stock[1]):
        assert torch.equal(got.isnan(), st.isnan()) and torch.equal(got.isinf(), st.isinf())
