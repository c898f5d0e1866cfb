"""Vocab-parallel rows a mask leaves out (``fx_passes/distributed/shard_mask.py``, the
proof; ``masked_stages.py``, the op): a Megatron-style step whose lm_head runs in the
one-pass loop, on a one-rank gloo group (the collectives run; tests/test_vocab_parallel.py's
slow runs take 2 and 4 ranks).  Against FP64 and stock: each spelling of the heads with a
``where`` or multiplicative mask, none / some / every row masked, bf16 and fp16, dynamic
shapes, non-finite values in masked and kept rows and an infinite incoming gradient
(stock's NaN pattern); the rows the GEMMs run."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from fx_passes.distributed import masked_stages, one_pass
from tests.helpers import rewrite_graphs
from tests.numerics import assert_no_less_accurate, reference
from tests.shard_heads import SMALL_BUDGET, T, entropy, lm_inputs, logprob, logprob_unshifted

pytestmark = pytest.mark.usefixtures("one_rank_group")  # (conftest)

HEADS = {"logprob": logprob, "entropy": entropy, "logprob_unshifted": logprob_unshifted}


def _step(head, where: bool):
    def fn(h, w, tok, mask, up=torch.float32):
        y = head(h @ w.t(), tok, up)
        kept = torch.where(mask > 0, y, 0.0) if where else y * mask.to(up)
        return kept.sum() / mask.to(up).sum()
    return fn


def _inputs(dtype, masked: float, rows: int = T):
    h, w, tok = lm_inputs(dtype, logprob)
    g = torch.Generator().manual_seed(rows)
    if rows != T:
        h = torch.randn(rows, h.shape[1], generator=g).to(dtype)
        tok = torch.randint(0, w.shape[0], (rows,), generator=g)
    mask = (torch.rand(rows, generator=g) >= masked).float()
    return [h, w, tok, mask]


def _run(fn, data, grad_out=1.0):
    """(outputs, gradients of h and w) of ``fn`` on copies of ``data``."""
    h, w = (t.detach().clone().requires_grad_() for t in data[:2])
    out = fn(h, w, *data[2:])
    out.backward(torch.full_like(out, grad_out))
    return [out.detach()], [h.grad, w.grad]


def _compiled(fn, backend, data, grad_out=1.0, dynamic=None):
    torch._dynamo.reset()
    counters.clear()
    options = SMALL_BUDGET if backend == "chunked_logits" else None
    return _run(torch.compile(fn, backend=backend, options=options, dynamic=dynamic), data, grad_out)


def _skipped() -> int:
    c = counters["chunked_logits"]
    assert c["masked_rows"] == 1 and c["rows_seen"] > 0, dict(c)
    return c["rows_skipped"]


CASES = [("logprob", True, 0.5, torch.bfloat16), ("logprob", False, 0.5, torch.float16),
         ("logprob", True, 0.0, torch.bfloat16), ("logprob", False, 1.0, torch.bfloat16),
         ("entropy", False, 0.75, torch.bfloat16), ("logprob_unshifted", True, 0.25, torch.float16)]


@pytest.mark.sampled(3)
@pytest.mark.parametrize("head,where,masked,dtype", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_rows_left_out_give_stocks_results(head, where, masked, dtype):
    fn, data = _step(HEADS[head], where), _inputs(dtype, masked)
    stock = _compiled(fn, "inductor", data)
    ours = _compiled(fn, "chunked_logits", data)
    skipped, left_out = _skipped(), int((data[3] == 0).sum())
    assert skipped <= left_out and (skipped > 0) == (left_out > 0), (skipped, left_out)
    if masked == 1.0:  # (every row left out: the loss is 0 / 0 as stock's, the gradients 0)
        assert torch.isnan(ours[0][0]).item() and torch.isnan(stock[0][0]).item()
        for got, st in zip(ours[1], stock[1]):
            torch.testing.assert_close(got, st, equal_nan=True)
        return
    assert_no_less_accurate(ours, stock, reference(fn, data, (0, 1)), dtype, 2e-2, 2e-2)


def test_dynamic_lengths_skip_rows_in_one_compile():
    fn = _step(logprob, False)
    for rows in (T, 53):
        data = _inputs(torch.bfloat16, 0.5, rows)
        stock = _compiled(fn, "inductor", data, dynamic=True)
        ours = _compiled(fn, "chunked_logits", data, dynamic=True)
        assert _skipped() > 0
        assert_no_less_accurate(ours, stock, reference(fn, data, (0, 1)), torch.bfloat16, 2e-2, 2e-2)


def _gemm_areas(monkeypatch, data) -> tuple[int, int]:
    """Rows x columns of the lm_head matmuls a compiled step runs on ``data``, in the
    forward and in the backward (real tensors only: not the fake ones tracing uses)."""
    calls, linear = [], torch.nn.functional.linear

    def counted(a, b, *rest):
        if not isinstance(a, torch._subclasses.FakeTensor):
            calls.append(a.shape[0] * b.shape[0])
        return linear(a, b, *rest)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(_step(logprob, True), backend="chunked_logits", options=SMALL_BUDGET)
    monkeypatch.setattr(torch.nn.functional, "linear", counted)
    h, w = (t.clone().requires_grad_() for t in data[:2])
    out = step(h, w, *data[2:])
    forward = sum(calls)
    out.backward()
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    return forward, sum(calls) - forward


def test_the_gemms_run_only_the_kept_rows(monkeypatch):
    """Half the rows masked: the forward's and the backward's GEMMs run the kept rows
    (rounded up to whole granules), against every row with no row masked."""
    data = _inputs(torch.bfloat16, 0.5)
    every = _gemm_areas(monkeypatch, [*data[:3], torch.ones(T)])
    masked = _gemm_areas(monkeypatch, data)
    ran = T - _skipped()
    assert int((data[3] != 0).sum()) <= ran < T
    assert masked[0] * T == every[0] * ran and masked[1] * T == every[1] * ran, (masked, every, ran)


@pytest.mark.parametrize("grad_out", [float("inf"), float("nan")])
def test_an_infinite_incoming_gradient_gives_stocks_nan_pattern(grad_out, monkeypatch):
    """``y * mask`` with an infinite loss gradient: a masked row's cotangent is ``inf * 0``,
    NaN; the backward runs every row, as stock's (it fails without that)."""
    fn, data = _step(logprob, False), _inputs(torch.bfloat16, 0.5)
    stock = _compiled(fn, "inductor", data, grad_out)
    again = []
    forward = one_pass._forward

    def counted(*args):
        again.append(args[1].shape[0])
        return forward(*args)
    monkeypatch.setattr(one_pass, "_forward", counted)
    ours = _compiled(fn, "chunked_logits", data, grad_out)
    assert _skipped() > 0 and again[-1] == T  # (the backward ran the forward again, every row)
    for got, st in zip(ours[1], stock[1]):
        assert torch.equal(got.isnan(), st.isnan()) and torch.equal(got.isinf(), st.isinf())


@pytest.mark.parametrize("where,row,value", [(True, "masked", float("inf")), (False, "masked", float("nan")),
                                              (False, "kept", float("inf")), (True, "kept", float("nan"))],
                         ids=["where-masked-inf", "mul-masked-nan", "mul-kept-inf", "where-kept-nan"])
def test_non_finite_hidden_states_give_stocks_pattern(where, row, value):
    """A masked row whose hidden state holds inf or NaN is not left out (its bound is not
    finite): loss and gradients NaN where stock's are, as a kept row's."""
    fn, data = _step(logprob, where), _inputs(torch.bfloat16, 0.5)
    at = int((data[3] == 0 if row == "masked" else data[3] != 0).nonzero()[0])
    data[0][at, 3] = value
    stock = _compiled(fn, "inductor", data)
    ours = _compiled(fn, "chunked_logits", data)
    assert _skipped() > 0
    for got, st in zip(ours[0] + ours[1], stock[0] + stock[1]):
        assert torch.equal(got.isnan(), st.isnan()) and torch.equal(got.isinf(), st.isinf())


def test_the_masked_op_is_the_call_and_reads_the_mask():
    """The rewritten graph calls ``shard_lm_head_stages_masked`` with the mask among the
    nodes its skip graph reads (not the plain one-pass call)."""
    fn, data = _step(logprob, True), _inputs(torch.bfloat16, 0.5)
    _, after = rewrite_graphs(fn, *data, **SMALL_BUDGET)
    calls = [n for n in after.graph.nodes if n.op == "call_function"]
    masked = [n for n in calls if n.target is masked_stages.shard_lm_head_stages_masked]
    assert len(masked) == 1 and not [n for n in calls if n.target is one_pass.shard_lm_head_stages]
    assert any("mask" in a.name for o in masked[0].kwargs["mask_operands"] for a in [o, *o.all_input_nodes])
