"""The ``"gpu"`` plan's loss loop at its floor (issue 54, item 2): few, large row chunks
(``tiling.gpu_loss_rows``, NOTE [gpu loss chunks]) and per chunk only the kernels the maths
needs (``gpu_plan.fp32_chunk_grads``, NOTE [gpu loss chunk]): the logits GEMM, its row
kernels, ``grad_hidden``'s GEMM writing its FP32 rows, and ``grad_weight``'s GEMM writing
(the first chunk) or adding into (every later one) the FP32 accumulator: no zero-fill, no
copy, no separate add.  Run on this CPU with the test-only ``out_dtype`` kernels
(``fx_passes.testing.gemms``); the ATen calls of one training step are traced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from fx_passes.kernels import tiling
from fx_passes.testing.gemms import cpu_out_dtype_kernels, tracing

T, H, V = 256, 64, 1024
GIB, MIB = 2**30, 2**20
F32, BF16 = torch.float32, torch.bfloat16
WV = (8192, 151936)  # (T, V) of the recorded H200 run (benchmarks/gpu_runs/2026-12-04)


@pytest.mark.parametrize("total_gib, t, chunks", [
    (80, 8192, 4), (140, 8192, 4),     # H100 / H200 at WV's size: the recorded run had 4 on the H200
    (140, 16384, 4), (80, 16384, 4),   # 5 and 8 by the budget alone: at most MAX_LOSS_CHUNKS
    (140, 32768, 4),
    (140, 100, 4), (140, 0, 0),
])
def test_few_large_chunks_on_a_gpu(total_gib, t, chunks):
    budget = tiling.device_budget("cuda", total_gib * GIB)
    rows = tiling.gpu_loss_rows(budget, t, WV[1])
    spans = tiling.even_splits(t, rows)
    assert len(spans) == chunks and 2 <= chunks <= tiling.MAX_LOSS_CHUNKS or t == 0
    # a chunk's model-precision logits and gradient: at most the bytes of the bf16 logits stock keeps
    assert all(4 * (b - a) * WV[1] <= 2 * t * WV[1] for a, b in spans)


def test_a_budget_the_user_sets_bounds_the_chunk():
    budget = 32 * MIB  # chunk_budget_mib=32 (a CPU's default too)
    assert tiling.gpu_loss_rows(budget, *WV, by_device=False) == tiling.forward_rows(budget, *WV) == 55
    assert tiling.gpu_loss_rows(budget, *WV) == 2048  # the device's: 4 chunks


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
    rows = T // tiling.MAX_LOSS_CHUNKS  # 4 chunks of 64 rows (the device's budget)
    gemms = [(o.op, o.shape, o.dtype) for o in ops if o.op.startswith(("aten.mm", "aten.addmm"))]
    first = [("aten.mm.out", (rows, V), BF16),              # the logits chunk (the compiled body's GEMM)
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
