"""The ``"gpu"`` plan's loss loop at its floor (issue 54, item 2): few, large row chunks
(``tiling.gpu_loss_rows``, NOTE [gpu loss chunks]) and per chunk only the kernels the maths
needs (``gpu_plan.fp32_chunk_grads``, NOTE [gpu loss chunk]): the logits GEMM, its row
kernels, ``grad_hidden``'s GEMM writing its FP32 rows, and ``grad_weight``'s GEMM writing
(the first chunk) or adding into (every later one) the FP32 accumulator: no zero-fill, no
copy, no separate add.  Run on this CPU with the test-only ``out_dtype`` kernels
(``fx_passes.testing.gemms``); the ATen calls of one training step are traced."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from fx_passes.kernels import tiling
from fx_passes.testing.codegen import allocations
from fx_passes.testing.gemms import cpu_out_dtype_kernels, tracing
from tests.codegen import inputs_of_rank
from tests.helpers import made_otherwise_before

T, H, V = 256, 64, 1024
GIB, MIB = 2**30, 2**20
F32, BF16 = torch.float32, torch.bfloat16
WV = (8192, 151936)  # (T, V) of the recorded H200 run (benchmarks/gpu_runs/2026-12-04)


@pytest.mark.parametrize("total_gib, t, chunks", [
    (80, 8192, 2), (140, 8192, 2),     # H100 / H200 at WV's size: the recorded run had 4 on the H200
    (140, 16384, 2), (80, 16384, 2),   # 5 and 8 by the budget alone: at most MAX_LOSS_CHUNKS
    (140, 32768, 2),
    (140, 100, 2), (140, 0, 0),
])
def test_few_large_chunks_on_a_gpu(total_gib, t, chunks):
    budget = tiling.device_budget("cuda", total_gib * GIB)
    rows = tiling.gpu_loss_rows(budget, t, WV[1])
    spans = tiling.even_splits(t, rows)
    assert len(spans) == chunks == tiling.MAX_LOSS_CHUNKS or t == 0
    # a chunk's model-precision logits, their gradient written in their place: at most half
    # the bytes of the bf16 logits stock keeps
    assert all(2 * (b - a) * WV[1] <= t * WV[1] for a, b in spans)


def test_a_budget_the_user_sets_bounds_the_chunk():
    budget = 32 * MIB  # chunk_budget_mib=32 (a CPU's default too)
    assert tiling.gpu_loss_rows(budget, *WV, by_device=False) == tiling.forward_rows(budget, *WV) == 55
    assert tiling.gpu_loss_rows(budget, *WV) == 4096  # the device's: 2 chunks


def ce(hidden, weight, labels):
    return F.cross_entropy((hidden @ weight.T).float(), labels)


def _traced_step():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g).to(BF16).requires_grad_()
    w = (torch.randn(V, H, generator=g) / H**0.5).to(BF16).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g)
    counters.clear()
    options = {"lm_head_plan": "gpu", "skip_masked_rows": False}
    fn = torch.compile(ce, backend="chunked_logits", options=options)
    with cpu_out_dtype_kernels():
        fn(h, w, labels).backward()  # compiles the graphs and the loop's bodies
        with tracing() as ops:
            fn(h, w, labels).backward()
    assert counters["chunked_logits"]["gradients_in_forward"] == 1, dict(counters["chunked_logits"])
    return ops


def test_each_chunk_runs_its_gemms_and_nothing_between_them():
    ops = _traced_step()
    rows = T // tiling.MAX_LOSS_CHUNKS  # 2 chunks of 128 rows (the device's budget)
    gemms = [(o.op, o.shape, o.dtype) for o in ops if o.op.startswith(("aten.mm", "aten.addmm"))]
    first = [("aten.mm.default", (rows, V), BF16),          # the logits chunk
             ("aten.mm.dtype_out", (rows, H), F32),         # grad_hidden[chunk] = g @ W, into its FP32 rows
             ("aten.mm.dtype_out", (V, H), F32)]            # grad_weight written: beta 0, no zero-fill
    later = [first[0], first[1], ("aten.addmm.dtype_out", (V, H), F32)]  # added to inside the GEMM
    assert gemms == first + later * (tiling.MAX_LOSS_CHUNKS - 1)
    # the FP32 sums are allocated (not filled) and touched by their GEMMs only: no zero-fill,
    # copy or add of an FP32 [V, H] or [rows, H] tensor
    sums = [o for o in ops if o.dtype == F32 and len(o.shape) == 2 and o.shape[1] == H]
    allowed = ("aten.new_empty.default", "aten.slice.Tensor", "aten.mm.dtype_out", "aten.addmm.dtype_out",
               "aten.t.default")
    assert [o for o in sums if o.op not in allowed] == []
    assert sum(o.op == "aten.new_empty.default" for o in sums) == 2  # grad_hidden [T, H], grad_weight [V, H]


def logprob(hidden, weight, tok):
    return torch.log_softmax((hidden @ weight.T).float(), -1).gather(-1, tok[:, None]).squeeze(-1)


def test_per_token_blocks_write_then_add_the_fp32_grad_hidden():
    """The per-token path (``gpu_plan.out_dtype_blocks``): per vocabulary block the logits
    recomputed, ``grad_weight[block]`` one bf16 GEMM over all rows, ``grad_hidden``'s FP32
    sum written by the first block's GEMM and added to inside every later one; one
    downcast at the end, no zero-fill."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g).to(BF16).requires_grad_()
    w = (torch.randn(V, H, generator=g) / H**0.5).to(BF16).requires_grad_()
    tok, coef = torch.randint(0, V, (T,), generator=g), torch.randn(T, generator=g)
    options = {"lm_head_plan": "gpu", "chunk_budget_mib": 0.25}
    fn = torch.compile(logprob, backend="chunked_logits", options=options)
    with cpu_out_dtype_kernels():
        (fn(h, w, tok) * coef).sum().backward()
        with tracing() as ops:
            (fn(h, w, tok) * coef).sum().backward()
    cols = tiling.gpu_block_cols(int(0.25 * MIB), T, V)
    blocks = len(tiling.even_splits(V, cols))
    assert blocks == 4
    backward = ops[next(i for i, o in enumerate(ops) if o.op == "aten.empty.memory_format"):]
    gemms = [(o.op, o.shape, o.dtype) for o in backward if o.op.startswith(("aten.mm", "aten.addmm"))]
    block = [("aten.mm.out", (T, cols), BF16), ("aten.mm.out", (cols, H), BF16)]
    assert gemms == (block + [("aten.mm.dtype_out", (T, H), F32)]
                     + (block + [("aten.addmm.dtype_out", (T, H), F32)]) * (blocks - 1))
    sums = [o.op for o in backward if o.dtype == F32 and o.shape == (T, H)]
    assert sums == ["aten.empty.memory_format", "aten.slice.Tensor", "aten.mm.dtype_out"] + [
        "aten.addmm.dtype_out"] * (blocks - 1)  # no zero_: the first block's GEMM writes it
    downcasts = [o for o in backward if o.op == "aten.copy_.default" and o.shape == (T, H)]
    assert [o.dtype for o in downcasts] == [BF16]  # grad_hidden rounded once


# ---- never more memory than stock (issue 54, item 3) -------------------------------------------

@pytest.mark.parametrize("rows, kind, stock_fp32, holds", [
    (4096, "cuda", False, False),   # WD: T = H, its FP32 sums were 1.52x stock's peak on the H200
    (8192, "cuda", False, False),   # WV (a cross-entropy alone): T = 2 H, 1.02x by the memory model
    (8192, "cuda", True, True),     # W4L (a log-prob: stock keeps the FP32 [T, V]): 0.52x
    (4096, "cuda", True, False),    # ... but not at T = H: 3657 MiB against stock's 3561
    (16384, "cuda", False, True), (2048, "xpu", False, False),
    (4096, "cpu", False, True),     # a CPU's plans hold no such sums
    (None, "cuda", False, True),    # T unknown at compile time (dynamic): as before
])
def test_fp32_weight_sums_only_where_stock_keeps_more(rows, kind, stock_fp32, holds):
    assert tiling.holds_weight_sums(rows, 151936, 4096, kind, stock_fp32) is holds


def test_the_rule_is_the_peaks_compared():
    """Held exactly where ours' peak (the FP32 sums, a chunk's logits with their gradient
    written in their place, or the rounded gradients) is at most stock's (its logits, and
    its FP32 [T, V] or gradients), at the H200 run's sizes: a cross-entropy alone from
    about 2.1 H rows, a log-prob from about 1.03 H."""
    V, H = 151936, 4096
    for stock_fp32, first in ((False, 8683), (True, 4210)):
        assert not tiling.holds_weight_sums(first - 1, V, H, "cuda", stock_fp32)
        assert tiling.holds_weight_sums(first, V, H, "cuda", stock_fp32)
        ours, stock = tiling.weight_sums_peaks(first, V, H, stock_fp32)
        assert ours <= stock and 4 * V * H < ours
    ours, stock = tiling.weight_sums_peaks(8192, V, H)
    assert (ours // MIB, stock // MIB) == (3753, 3625)  # stock: 2 T V + 2 V H + 2 T H
    # a row-local loss (its backward's 6 V H + 2 T H): from T = 2 H on, against a cross-entropy's stock
    assert tiling.holds_weight_sums(2 * H, V, H, "cuda", row_local=True)
    assert not tiling.holds_weight_sums(2 * H - 8, V, H, "cuda", row_local=True)


def test_a_short_loss_keeps_the_per_token_plan_and_says_why(monkeypatch, caplog):
    """On a GPU (the rule's device argument made "cuda" here) a cross-entropy whose FP32
    sums would peak above stock's keeps the per-token plan (vocabulary blocks over all
    rows, no FP32 [V, H] sum); from the first T where they do not, the loss in the graph."""
    from fx_passes.rewrite import loss_tail
    monkeypatch.setattr(loss_tail, "holds_weight_sums",
                        lambda rows, v, w, kind, *rest: tiling.holds_weight_sums(rows, v, w, "cuda", *rest))
    first = next(t for t in range(8, 4 * H) if tiling.holds_weight_sums(t, V, H, "cuda"))
    assert 2 * H < first < 3 * H  # (V 1024, H 64: 148)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(V, H, generator=g) / H**0.5).to(BF16).requires_grad_()
    for t, taken in ((first - 1, 0), (first, 1)):
        h = torch.randn(t, H, generator=g).to(BF16).requires_grad_()
        labels = torch.randint(0, V, (t,), generator=g)
        counters.clear()
        torch._dynamo.reset()
        fn = torch.compile(ce, backend="chunked_logits", options={"lm_head_plan": "gpu"})
        with cpu_out_dtype_kernels(), caplog.at_level("INFO", logger="fx_passes"):
            loss = fn(h, w, labels)
        torch.testing.assert_close(loss, ce(h, w, labels), rtol=1e-2, atol=1e-2)
        assert counters["chunked_logits"]["gradients_in_forward"] == taken, dict(counters["chunked_logits"])
        assert counters["chunked_logits"]["weight_sums_over_stock"] == 1 - taken
    assert "above stock's" in caplog.text and f"(T {first - 1}, V {V}, H {H})" in caplog.text
    assert "vocabulary blocks over all rows" in caplog.text


# ---- the logits gradient written over the logits (issue 54, item 2) ------------------------------

def _kernel_calls(code: str) -> list[tuple[str, list[str]]]:
    """The kernels the wrapper's ``call`` launches: (name, its arguments)."""
    body = code[code.index("def call(self, args)"):]
    return [(m[0], [a.strip() for a in m[1].split(",")])
            for m in re.findall(r"^\s+(cpp_fused_\w+|triton_\w+)(?:\.run)?\((.*)\)$", body, re.M)]


@pytest.mark.parametrize("transforms, scale, entropy", [
    ("", None, True),                                                           # lse, log-prob, entropy
    (f"div:{(30.0).hex()},tanh,mul:{(30.0).hex()}", torch.tensor(0.7), False),  # a soft cap, a temperature
], ids=["plain", "softcap"])
def test_the_gradient_is_written_over_the_logits_by_one_kernel(transforms, scale, entropy):
    """``loss._loop``'s gradient body (``logits_grad_into``), compiled as the loop compiles it:
    the wrapper Inductor generates launches one kernel, which reads the chunk's logits and
    writes their gradient into the same buffer (passed as its input and its output), and
    allocates nothing: no ``[r, V]`` temporary.  Bitwise the out-of-place body's gradient."""
    from fx_passes.kernels.log_softmax import bodies, loss
    from fx_passes.kernels.ops import body_compiler
    from fx_passes.kernels.ops.args import Cotangents, LogitMap, RowValues
    g = torch.Generator().manual_seed(0)
    r = 96
    x = (torch.randn(r, V, generator=g) * 4).to(BF16)
    tok = torch.randint(0, V, (r,), generator=g)
    lse = torch.logsumexp(x.float(), -1)
    saved = RowValues(lse, torch.rand(r, generator=g) if entropy else None)
    cot = Cotangents(*torch.randn(3, r, generator=g)) if entropy else Cotangents(
        *torch.randn(2, r, generator=g), None)
    logit_map = LogitMap(BF16, transforms, scale, True)
    expected = bodies.compiled(loss.logits_grad)(x, tok, saved, cot, logit_map)
    # (a compiler of its own: the body compiles here, not taken from the bodies' cache)
    with body_compiler.compiling_with(lambda fn, options: body_compiler._inductor(fn, options)):
        into = bodies.compiled(loss.logits_grad_into)
        storage = x.untyped_storage().data_ptr()
        _, codes = run_and_get_code(into, x, tok, saved, cot, logit_map)
    assert x.untyped_storage().data_ptr() == storage and torch.equal(x, expected)
    [code] = codes
    [name] = inputs_of_rank(code, 2)  # the logits: the one 2-D input
    [(kernel, args)] = _kernel_calls(code)
    assert args.count(name) == 2 or "in_out_ptr" in code, (kernel, args)
    assert allocations(code) == []


def _policy_tail() -> str:
    """A registered loss tail as ``rewrite.tail_graphs`` makes one: a masked policy term and an
    entropy bonus, summed (``(lse, logprob, entropy, mask, coef, *weights) -> (cotangents,
    sums)``)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fx_passes.kernels.log_softmax.loss_parts import trace_tail
    from fx_passes.kernels.ops import user_bodies

    def rows(lse, logprob, entropy, mask, coef):
        return -(logprob * mask), coef * entropy * mask
    key = user_bodies.register(make_fx(rows)(*torch.zeros(5, 3).unbind()[:4], torch.zeros(())))
    return trace_tail(key, 2, [*torch.zeros(4, 3).unbind(), *[torch.zeros(())] * 3])


@pytest.mark.sampled
@pytest.mark.parametrize("transforms, scale", [
    ("", None),
    pytest.param(f"div:{(30.0).hex()},tanh,mul:{(30.0).hex()}", torch.tensor(0.7),
                 marks=made_otherwise_before("2.13", "Inductor keeps no soft cap tile, and the fused "
                                             "body's gradient is not the separate bodies'"))],
    ids=["plain", "softcap"])
def test_a_chunk_reads_its_logits_in_one_kernel(transforms, scale):
    """``loss._loop``'s work on a chunk after its GEMM (``loss.chunk_body``: the stats, the
    loss tail's cotangents and sums, the gradient written over the logits) is one compiled
    function, so Inductor makes one kernel of it: the chunk's logits are read in that kernel
    only, which writes their gradient in their place, and nothing of the chunk's size is
    allocated but a soft cap's tile on a CPU.  Its results are those of the three separate
    bodies it replaces."""
    from fx_passes.kernels.log_softmax import bodies, given, loss
    from fx_passes.kernels.ops import body_compiler, user_bodies
    from fx_passes.kernels.ops.args import Cotangents, LogitMap, RowValues
    g = torch.Generator().manual_seed(0)
    r = 96
    x = (torch.randn(r, V, generator=g) * 4).to(BF16)
    tok = torch.randint(0, V, (r,), generator=g)
    mask, coef = (torch.rand(r, generator=g) > 0.3).float(), torch.tensor(0.01)
    weights = [torch.tensor(0.5)] * 2
    logit_map, tail_key = LogitMap(BF16, transforms, scale, True), _policy_tail()
    args = (logit_map, True, True, mask, coef, *weights)

    # the three bodies the loop ran before (stats; the tail; the gradient over the logits)
    z = bodies.transformed(x, transforms)[0]
    lse, lp, ent, lse_lo = bodies.compiled(given.stats_and_residual)(z, tok, scale, True, True)
    c_lse, c_lp, c_ent, *sums = user_bodies.body(tail_key)(lse, lp, ent, mask, coef, *weights)
    lse = given.softmax_lse(lse, True)
    expected = bodies.compiled(loss.logits_grad)(x, tok, RowValues(lse, ent, lse_lo),
                                                 Cotangents(c_lse, c_lp, c_ent), logit_map)
    with body_compiler.compiling_with(lambda fn, options: body_compiler._inductor(fn, options)):
        storage = x.untyped_storage().data_ptr()
        got, codes = run_and_get_code(loss.chunk_body(tail_key), x, tok, *args)
    assert x.untyped_storage().data_ptr() == storage
    for a, b in zip(got, (lse, ent, lse_lo, c_lse, c_lp, c_ent, *sums), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(x, expected)
    [code] = codes
    [name] = inputs_of_rank(code, 2)  # the logits: the one 2-D input
    [(kernel, kernel_args)] = _kernel_calls(code)
    assert kernel_args.count(name) == 2 or "in_out_ptr" in code, (kernel, kernel_args)
    tiles = [(dims, dtype) for dims, dtype in allocations(code) if len([d for d in dims if d != "1"]) > 1]
    # (per-row values and sums only; on a CPU Inductor keeps a reused tanh in a buffer, a soft
    # cap's FP32 tile, as the separate stats body did: ir.StorageBox.should_realize_on_reuse)
    assert tiles == ([] if not transforms else [(tiles[0][0], "torch.float32")]), tiles
