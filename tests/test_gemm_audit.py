"""The GEMM audit (issue 22): every matmul of one fused lm_head training step, per backward
plan, recorded on this CPU (``fx_passes.testing.gemms``), against each plan's budget in
docs/gemms.md; the GPU plan runs here through test-only CPU kernels for
``aten::mm.dtype`` / ``aten::addmm.dtype`` (the FP32 product of the model-precision
inputs, which is what the GPU computes).  The same steps are checked against FP64: no
plan is less accurate than stock Inductor.

The step is the recompute path: the compiled function returns per-token log-probs and
their gradient arrives in the backward.  Units: one ``[T, H] x [H, V]`` GEMM.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from fx_passes import compat
from fx_passes.kernels import tiling
from fx_passes.testing.gemms import cpu_out_dtype_kernels, full_gemms, recording
from tests.numerics import F32, assert_no_less_accurate, reference, run

T, H, V = 256, 128, 2048
BF16 = torch.bfloat16
MIB, GIB = 2**20, 2**30

# (full GEMMs in all, of them with FP32 inputs) per plan, at the default budget (one
# accumulator group).  docs/gemms.md states these numbers; "inductor" is stock (the control).
BUDGETS = {
    "inductor": (3, 0),
    "two_sweeps": (5, 0),
    "fp32_tiles": (4, 3),
    "blocks": (4, 1),
    "gpu": (4, 0),
}


def logprob(hidden, weight, tokens, up=F32):
    """Per-token log-probs of the lm_head's logits: an outer loss weights them, so the
    fused op recomputes the logits in the backward."""
    logits = hidden @ weight.T
    return torch.log_softmax(logits.to(up), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g).to(BF16)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(BF16)
    return (hidden, weight, torch.randint(0, V, (T,), generator=g)), (0, 1)


@pytest.fixture(scope="module")
def truth():
    """FP64 reference and stock Inductor's step (outputs, gradients, its GEMMs)."""
    inputs, grad_pos = _inputs()
    torch._dynamo.reset()
    stock = torch.compile(logprob, backend="inductor")
    run(stock, inputs, grad_pos)  # compiled before the recorded step
    with recording() as gemms:
        result = run(stock, inputs, grad_pos)
    return reference(logprob, inputs, grad_pos), result, gemms


def _audited_step(plan: str, **options):
    """One step of the fused function with ``plan`` forced: (result, its GEMMs)."""
    inputs, grad_pos = _inputs()
    counters.clear()
    fused = torch.compile(logprob, backend="chunked_logits", options={"lm_head_plan": plan, **options})
    with cpu_out_dtype_kernels():
        run(fused, inputs, grad_pos)  # compiles the graph and the loop bodies
        with recording() as gemms:
            result = run(fused, inputs, grad_pos)
    assert counters["chunked_logits"]["lm_head_fused"] == 1, dict(counters["chunked_logits"])
    return result, gemms


def _largest_fp32(gemms) -> float:
    return max((g.flops for g in gemms if g.in_dtype == torch.float32), default=0) / (2 * T * H * V)


def test_stock_runs_three_bf16_gemms(truth):
    """The control: stock Inductor's step, recorded the same way."""
    _, _, gemms = truth
    assert full_gemms(gemms, T, H, V) == pytest.approx(3)
    assert {g.in_dtype for g in gemms} == {BF16}


@pytest.mark.parametrize("plan", ["two_sweeps", "fp32_tiles", "blocks", "gpu"])
def test_each_plan_runs_its_gemms_and_is_no_less_accurate(plan, truth):
    ref, stock, _ = truth
    (outs, grads), gemms = _audited_step(plan)
    total, fp32 = BUDGETS[plan]
    assert full_gemms(gemms, T, H, V) == pytest.approx(total), gemms
    assert full_gemms(gemms, T, H, V, in_dtype=torch.float32) == pytest.approx(fp32), gemms
    if plan == "gpu":
        # <= 4 full GEMMs, no FP32-input GEMM above 1/16 of a full one (none at all), and
        # grad_hidden's sum across the vocabulary blocks in FP32 through out_dtype
        assert full_gemms(gemms, T, H, V) <= 4 + 1e-9 and _largest_fp32(gemms) <= 1 / 16
        assert {g.in_dtype for g in gemms} == {BF16}
        accumulated = [g for g in gemms if g.out_dtype == torch.float32]
        # (the first vocabulary block's GEMM writes the FP32 sum, every later one adds into it)
        assert accumulated and all(g.op.startswith(("aten.mm.dtype", "aten.addmm.dtype"))
                                   for g in accumulated)
        assert sum(g.flops for g in accumulated) == 2 * T * H * V  # grad_hidden: one full GEMM
    if plan == "blocks":  # what "gpu" replaces: FP32-input GEMMs, each above 1/16 of a full one here
        assert _largest_fp32(gemms) > 1 / 16
    assert_no_less_accurate((outs, grads), stock, ref, BF16, 2e-6, 2**-8)


def test_gpu_plan_bounded_accumulator_recomputes_the_rows_past_it(truth):
    """A budget whose half holds the FP32 grad_hidden of fewer than T rows (just under
    256 KiB: 255 rows of H 128): the rows split into two groups of 128, and the second takes
    a sweep of its own (its logits again and its grad_hidden): 4 + 128 / 256 GEMMs, still
    with model-precision inputs only, still as accurate."""
    ref, stock, _ = truth
    budget_mib = 0.2499
    groups = tiling.even_splits(T, tiling.accumulator_rows(int(budget_mib * MIB), T, H))
    assert groups == [(0, 128), (128, 256)]
    (outs, grads), gemms = _audited_step("gpu", chunk_budget_mib=budget_mib)
    assert full_gemms(gemms, T, H, V) == pytest.approx(4.5)
    assert {g.in_dtype for g in gemms} == {BF16}
    assert_no_less_accurate((outs, grads), stock, ref, BF16, 2e-6, 2**-8)


# ---- the device-dependent choices, as pure functions ------------------------------------------

@pytest.mark.parametrize("t,v,h,rows,blocks", [
    (4096, 151936, 1024, 1024, 4),    # WV: a quarter of the rows (the cap: a quarter of the FP32 logits)
    (16384, 32768, 1024, 4096, 4),    # W4L
    (32768, 151936, 4096, 3456, 10),  # long T: the 2 GiB budget
])
def test_gpu_sizes_run_near_peak(t, v, h, rows, blocks):
    """On an H200 (140 GiB; the default budget, tests/test_budget.py): thousands of rows
    per forward chunk, vocabulary blocks over all rows (grad_weight's K = T), one FP32
    grad_hidden group for all rows."""
    budget = tiling.device_budget("cuda", 140 * GIB)
    assert tiling.forward_rows(budget, t, v) == rows
    assert len(tiling.even_splits(v, tiling.gpu_block_cols(budget, t, v))) == blocks
    assert tiling.accumulator_rows(budget, t, h) == t


def test_cpu_sizes_unchanged():
    budget = tiling.device_budget("cpu", None)
    assert tiling.forward_rows(budget, 4096, 32768) == 256
    assert tiling.accumulator_rows(budget, 4096, 1024) == 4096


def test_plan_choice(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(compat, "gemm_out_dtype", lambda kind: kind in ("cuda", "xpu"))
    assert tiling.backward_plan(cuda, BF16) == tiling.backward_plan(torch.device("xpu"), BF16) == "gpu"
    assert tiling.backward_plan(cpu, BF16) in ("two_sweeps", "fp32_tiles")
    assert tiling.backward_plan(cpu, BF16, "blocks") == "blocks"
    monkeypatch.setattr(compat, "gemm_out_dtype", lambda kind: False)  # torch < 2.8
    assert tiling.backward_plan(cuda, BF16) == "blocks"
    assert tiling.backward_plan(cpu, BF16, "gpu") == "blocks"  # forced where no kernel: logged


def test_out_dtype_kernels_only_inside_the_block():
    assert not compat.gemm_out_dtype("cpu")
    with cpu_out_dtype_kernels():
        assert compat.gemm_out_dtype("cpu")
        assert tiling.backward_plan(torch.device("cpu"), BF16, "gpu") == "gpu"
    assert not compat.gemm_out_dtype("cpu")
