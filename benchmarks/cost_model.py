"""Predicted step time of stock Inductor and of chunked_logits on H100 / H200 (issue 22, item 5).

    .venv/bin/python benchmarks/cost_model.py                  # the H100 / H200 table
    .venv/bin/python benchmarks/cost_calibrate.py --calibrate  # this CPU's rates: predicted vs measured
    .venv/bin/python benchmarks/cost_calibrate.py --audit      # the modelled GEMMs vs a recording
    .venv/bin/python benchmarks/cost_measured.py               # vs the recorded H200 run

A prediction, not a measurement.  Each step is a list of kernels; a kernel takes
``max(GEMM FLOPs / rate(input dtype), bytes / bandwidth, exps / exp rate)`` (a roofline
per kernel) plus a launch overhead, and a step the sum over its kernels.  The kernels:

* stock Inductor: its generated code (read on the CPU at small size; assumed the same
  kernels in Triton): the ``[T, H] x [H, V]`` GEMMs (3 with the lm_head in the graph), the
  forward's row reduction over the model-precision logits, and the backward's row
  kernel.  For the token log-probs (W3, W4, W4L) the backward zero-fills an FP32
  ``[T, V]`` buffer (the gather's gradient), then reads it and the logits and writes
  the model-precision gradient; for cross-entropy (WV) it reads the logits and writes
  the gradient.
* chunked_logits: W3 reads the logits in the forward and reads them and writes their
  gradient in the backward.  With the lm_head fused, the loops of
  ``fx_passes/kernels/log_softmax/lm_head.py``, ``lm_head_sweeps.py`` and ``gpu_plan.py`` at the
  device's chunk budget
  (``kernels.tiling``'s sizes): per chunk or block a GEMM that writes the logits tile,
  a body that reads it (and writes its gradient in the backward), the gradient GEMMs,
  the FP32 accumulators they read and write, and the FP32 copies of ``fp32_tiles`` /
  ``blocks``.  ``gradients_in_forward`` (the loss in the graph): ``fx_passes/kernels/log_softmax/loss.py``,
  row chunks that also form the gradient tile and write ``grad_hidden`` in one GEMM,
  then on ``gpu`` each chunk's ``grad_weight`` added into an FP32 ``[V, H]`` buffer
  (``out_dtype``; 3 GEMMs), on ``two_sweeps`` a vocabulary sweep in the backward
  (4 GEMMs; the incoming gradient 1, as ``loss.backward()`` gives it).

A GEMM moves its operands and its output once (an accumulating one reads its output
too); an elementwise kernel its inputs and outputs once (a row's several passes inside
one kernel hit the cache).  On a CPU a buffer over 32 MiB is mapped fresh every step and
its pages fault in at its first write (``Device.first_touch``); a GPU's caching
allocator reuses its blocks.  ``--calibrate`` measures this CPU's rates (GEMMs, copy,
an Inductor exp pass, first touch) and sets the predicted ratios of W3 and W4 beside
``run.py``'s measured ones (docs/gpu.md, "Predicted").  ``--audit`` compiles W4 and WV at small size with each
plan forced and compares the recorded GEMMs (``fx_passes.testing.gemms``) with the
modelled ones.  Both live in ``benchmarks/cost_calibrate.py``, which imports this module
(this one imports nothing of ``benchmarks``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import sys
from typing import Callable, Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fx_passes.kernels import tiling  # noqa: E402

GB, MIB = 1e9, 2**20
REUSED_BYTES = 32 * MIB
BF16, FP32 = "bf16", "fp32"
SIZE = {BF16: 2, FP32: 4}
H_LM = 1024  # H of W4, W4L and WV (fx_passes/testing/workloads.py, _make_lm_head)
WORKLOADS = {  # name: (T, H or 0 when the logits are an input, V, loss)
    "W3": (2048, 0, 32768, "logprob"),
    "W4": (4096, H_LM, 32768, "logprob"),
    "W4L": (16384, H_LM, 32768, "logprob"),
    "WV": (4096, H_LM, 151936, "ce"),
    "W4L-8k": (8192, 4096, 151936, "logprob"),  # the H200 run's sizes (benchmarks/gpu_runs/2026-12-04)
    "WV-8k": (8192, 4096, 151936, "ce"),
}
PLANS = ("gpu", "blocks", "two_sweeps", "fp32_tiles")  # the lm_head backward plans modelled
# Issue 22's targets, on the H200, for the "gpu" plan: (workload, gradients in forward) -> bound
TARGETS = {("W4", True): 0.9, ("WV", True): 0.9, ("W4", False): 1.05, ("WV", False): 1.05,
           # issue 54's, at the H200 run's sizes
           ("W4L-8k", True): 0.95, ("WV-8k", True): 0.95, ("W4L-8k", False): 1.15, ("WV-8k", False): 1.15}


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    flops: dict  # GEMM FLOP/s by input dtype
    bandwidth: float  # bytes/s
    exps: float  # FP32 exp() per second
    launch_s: float  # per kernel
    total_bytes: int  # the device memory the chunk budget is a share of (tiling.device_budget)
    kind: str  # "cuda" or "cpu"
    source: str
    first_touch: float = math.inf  # bytes/s of faulting in a fresh buffer's pages (a GPU: none)
    # Calibrated on a measured run (``CALIBRATION``; 1.0 / False / 0: the plain roofline):
    gemm_eff: float = 1.0  # the share of ``flops`` a GEMM's main loop reaches
    sweep_eff: float = 1.0  # times that, a GEMM of the backward's recompute sweeps
    epilogue: bool = False  # a GEMM's output traffic adds to its time (else: the roofline's max)
    step_s: float = 0.0  # the rest of the step (outside the region): the same for stock and ours


# Fitted on the H200 run of 2026-12-04 (``benchmarks/cost_measured.py``, docs/gpu.md "Where the
# time goes"): a GEMM's main loop at 0.81 of the datasheet's rate (stock's three GEMMs: 786
# TFLOPS in the profiler, its output traffic added), the backward's recompute-sweep GEMMs at
# 0.92 of that (their profiled time), 130 us a kernel of ours (the loops' host time and
# allocations between kernels: their median steps less their kernels), 4.4 ms for the rest of
# a step (the same for stock and ours).  The H100 takes the same factors (not measured there).
CALIBRATION = dict(gemm_eff=0.81, sweep_eff=0.92, epilogue=True, step_s=4.4e-3)
LAUNCH_S = 130e-6
DEVICES = (
    Device("H100 SXM", {BF16: 989e12, FP32: 67e12}, 3.35e12, 132 * 16 * 1.98e9, LAUNCH_S, 79 * 2**30, "cuda",
           "NVIDIA H100 datasheet: 989 TFLOPS bf16 dense (1979 with sparsity), 67 TFLOPS FP32 (no "
           "TF32), 3.35 TB/s HBM3; exp: 132 SMs x 16 ex2/clk x 1.98 GHz (CUDA guide, cc 9.0); "
           "the H200's calibration", **CALIBRATION),
    Device("H200 SXM", {BF16: 989e12, FP32: 67e12}, 4.8e12, 132 * 16 * 1.98e9, LAUNCH_S, 140 * 2**30, "cuda",
           "NVIDIA H200 datasheet: the H100's FLOPS, 4.8 TB/s HBM3e, 141 GB; calibrated on "
           "benchmarks/gpu_runs/2026-12-04", **CALIBRATION),
)


@dataclasses.dataclass(frozen=True)
class Kernel:
    what: str
    flops: float = 0.0  # GEMM FLOPs
    dtype: str = BF16  # the GEMM's input dtype
    bytes: float = 0.0
    exps: float = 0.0
    n: int = 1  # identical kernels
    shape: tuple = ()  # a GEMM's (m, k, n)
    fresh: float = 0.0  # bytes it writes into a buffer allocated this step (``fresh``)
    out_bytes: float = 0.0  # a GEMM's output traffic (written, and read when it accumulates)
    sweep: bool = False  # a GEMM of a backward recompute sweep (``Device.sweep_eff``)


def kernel_time(k: Kernel, dev: Device) -> float:
    if k.flops:
        compute = k.flops / (dev.flops[k.dtype] * dev.gemm_eff * (dev.sweep_eff if k.sweep else 1.0))
        one = compute + k.out_bytes / dev.bandwidth if dev.epilogue else max(compute, k.bytes / dev.bandwidth)
    else:
        one = max(k.bytes / dev.bandwidth, k.exps / dev.exps)
    launch = dev.launch_s if one else 0.0  # (a buffer's allocation alone launches nothing)
    return k.n * (one + k.fresh / dev.first_touch + launch)


def step_time(kernels: list[Kernel], dev: Device) -> float:
    return dev.step_s + sum(kernel_time(k, dev) for k in kernels)


def fresh(nbytes: float) -> float:
    """The bytes of a buffer a step allocates that a CPU maps fresh each step: over 32 MiB
    (glibc's largest mmap threshold), so its pages fault in on first touch.  (A GPU's
    caching allocator reuses its blocks: ``Device.first_touch`` is infinite there.)"""
    return nbytes if nbytes > REUSED_BYTES else 0.0


def gemm(what: str, m: int, k: int, n: int, dtype: str = BF16, out: str = BF16, acc: bool = False,
         count: int = 1, new: bool = False, sweep: bool = False) -> Kernel:
    """``[m, k] x [k, n]``: its operands read once, its output written (and read: ``acc``);
    ``new``: the output is a buffer of its own (``fresh``); ``sweep``: a GEMM of a
    backward recompute sweep."""
    s, out_io = SIZE[dtype], SIZE[out] * m * n * (2 if acc else 1)
    new_bytes = fresh(SIZE[out] * m * n) if new else 0.0
    io = s * (m * k + k * n) + out_io
    return Kernel(what, 2.0 * m * k * n, dtype, io, 0.0, count, (m, k, n), new_bytes, out_io, sweep)


def elementwise(what: str, read: float, write: float = 0.0, exps: float = 0.0, count: int = 1,
                new: float = 0.0) -> Kernel:
    """``new``: the bytes of its output that are a buffer of its own (``fresh``)."""
    return Kernel(what, 0.0, BF16, read + write, exps, count, (), fresh(new))


def full_gemms(kernels: list[Kernel], T: int, H: int, V: int, dtype: Optional[str] = None) -> float:
    """GEMM FLOPs in units of one ``[T, H] x [H, V]`` (``dtype``: inputs of that dtype only)."""
    return sum(k.n * k.flops for k in kernels if dtype in (None, k.dtype)) / (2.0 * T * H * V)


def moved_bytes(kernels: list[Kernel]) -> float:
    return sum(k.n * k.bytes for k in kernels)


# --- stock Inductor -------------------------------------------------------------------

def stock(T: int, H: int, V: int, loss: str) -> list[Kernel]:
    """Stock Inductor's kernels (its C++ code; the backward's gradient reuses the logits'
    buffer when the lm_head made them)."""
    ks = [gemm("logits", T, H, V, new=True)] if H else []
    ks.append(elementwise("forward row reduction", 2 * T * V, exps=T * V))
    grad_new = 0 if H else 2 * T * V
    if loss == "logprob":  # gather's gradient: an FP32 [T, V] buffer, zero-filled, then read
        ks += [elementwise("zero-fill FP32 [T, V]", 0, 4 * T * V, new=4 * T * V),
               elementwise("backward row kernel", 6 * T * V, 2 * T * V, exps=T * V, new=grad_new)]
    else:
        ks.append(elementwise("backward row kernel", 2 * T * V, 2 * T * V, exps=T * V, new=grad_new))
    if H:
        ks += [gemm("grad_hidden", T, V, H, new=True), gemm("grad_weight", V, T, H, new=True)]
    return ks


# --- chunked_logits ---------------------------------------------------------------------

def splits(total: int, most: int) -> list[int]:
    """The piece sizes of ``tiling.even_splits``."""
    return [b - a for a, b in tiling.even_splits(total, most)]


def tile(what: str, rows: int, cols: int, H: int, backward: bool, dtype: str = BF16) -> list[Kernel]:
    """A logits tile's GEMM and the body that reduces it (and writes its gradient); a
    backward tile's GEMM is one of a recompute sweep (``Device.sweep_eff``)."""
    out = BF16 if dtype == BF16 else FP32
    body = elementwise(f"{what} body", SIZE[out] * rows * cols, 2 * rows * cols if backward else 0,
                       exps=rows * cols)
    return [gemm(f"{what} logits", rows, H, cols, dtype, out, sweep=backward), body]


def forward_loop(budget: int, T: int, H: int, V: int) -> list[Kernel]:
    """``lm_head._forward_loop``: chunks of ``forward_rows`` rows, the last one shorter."""
    ks, rows = [], tiling.forward_rows(budget, T, V)
    for r0 in range(0, T, rows):
        ks += tile("forward", min(T, r0 + rows) - r0, V, H, backward=False)
    return ks


def two_sweeps(budget: int, T: int, H: int, V: int) -> list[Kernel]:
    rows, cols = tiling.sweep_sizes(budget, T, V)
    ks = []
    for r in splits(T, rows):
        ks += tile("recompute rows", r, V, H, True) + [gemm("grad_hidden", r, V, H, sweep=True)]
    for c in splits(V, cols):
        ks += tile("recompute block", T, c, H, True) + [gemm("grad_weight", c, T, H, sweep=True)]
    return ks


def gpu(budget: int, T: int, H: int, V: int) -> list[Kernel]:
    """``gpu_plan.out_dtype_blocks``: blocks over all rows, ``grad_hidden`` summed in FP32
    through ``out_dtype`` per group of rows."""
    ks = []
    for i, g in enumerate(splits(T, tiling.accumulator_rows(budget, T, H))):
        n = T if i == 0 else g  # the first sweep reads every row for grad_weight
        for j, c in enumerate(splits(V, tiling.gpu_block_cols(budget, n, V))):
            ks += tile("recompute block", n, c, H, True)
            if i == 0:
                ks.append(gemm("grad_weight", c, n, H, sweep=True))
            # (the first block's GEMM writes the FP32 sum, every later one adds into it)
            ks.append(gemm("grad_hidden (out_dtype FP32)", g, c, H, out=FP32, acc=j > 0, sweep=True))
        ks.append(elementwise("grad_hidden FP32 -> bf16", 4 * g * H, 2 * g * H))
    return ks


def blocks(budget: int, T: int, H: int, V: int, fp32: bool = False) -> list[Kernel]:
    """``lm_head_sweeps._Backward.sweep`` per group of rows (``fp32``: the ``fp32_tiles`` plan)."""
    ks, dt = [], FP32 if fp32 else BF16
    for i, (r0, r1) in enumerate(tiling.even_splits(T, tiling.accumulator_rows(budget, T, H))):
        first, last = (0, T) if i == 0 else (r0, r1)  # the first sweep reads every row for grad_weight
        cols, rows = tiling.backward_tiles(budget, last - first, V, H, fp32)
        for c in splits(V, cols):
            ks.append(elementwise("weight block -> FP32", 2 * c * H, 4 * c * H))
            for t0, t1 in tiling.even_splits(last - first, rows):
                r, a = t1 - t0, min(t1 + first, r1) - max(t0 + first, r0)  # a: rows this group sums
                if fp32:
                    ks.append(elementwise("hidden tile -> FP32", 2 * r * H, 4 * r * H))
                ks += tile("recompute tile", r, c, H, True, dt)
                ks.append(elementwise("gradient tile -> FP32", 2 * r * c, 4 * r * c))
                if i == 0:
                    ks.append(gemm("grad_weight", c, r, H, dt, dt, acc=fp32, sweep=True))
                if a > 0:
                    ks.append(gemm("grad_hidden (FP32)", a, c, H, FP32, FP32, acc=True, sweep=True))
            if fp32 and i == 0:
                ks.append(elementwise("grad_weight block -> bf16", 4 * c * H, 2 * c * H))
        ks.append(elementwise("grad_hidden FP32 -> bf16", 4 * (r1 - r0) * H, 2 * (r1 - r0) * H))
    return ks


def _gif_chunks(budget: int, T: int, H: int, V: int, out: str) -> list[Kernel]:
    """``lm_head_loss._loop``'s row chunks: logits and stats, the gradient tile, and
    ``grad_hidden[chunk]`` in one GEMM (FP32 output on the ``gpu`` plan)."""
    ks = []
    for r in splits(T, tiling.forward_rows(budget, T, V)):
        ks += tile("forward", r, V, H, backward=False)
        ks += [elementwise("gradient body", 2 * r * V, 2 * r * V, exps=r * V),
               gemm("grad_hidden", r, V, H, out=out)]
    return ks


def gif_gpu(budget: int, T: int, H: int, V: int, kind: str = "cuda", by_device: bool = True) -> list[Kernel]:
    """``lm_head_loss``, ``gpu`` (``gpu_plan.fp32_chunk_grads``): 3 GEMMs over at most
    ``tiling.MAX_LOSS_CHUNKS`` row chunks; per chunk ``grad_hidden`` written in FP32 by its
    GEMM, the FP32 ``[V, H]`` ``grad_weight`` written by the first chunk's GEMM and added to
    inside every later one; the backward scales both FP32 gradients and rounds them
    (``by_device``: the device's budget, else one the user set)."""
    ks = []
    for i, r in enumerate(splits(T, tiling.gpu_loss_rows(budget, T, V, by_device))):
        ks += tile("forward", r, V, H, backward=False)
        ks += [elementwise("gradient body", 2 * r * V, 2 * r * V, exps=r * V),
               gemm("grad_hidden (out_dtype FP32)", r, V, H, out=FP32),
               gemm("grad_weight (out_dtype FP32)", V, r, H, out=FP32, acc=i > 0)]
    return ks + _scaled(T, H, V)


def gif_gpu_2026_12_04(budget: int, T: int, H: int, V: int, kind: str = "cuda", by_device: bool = True
                       ) -> list[Kernel]:
    """``gif_gpu`` as the H200 run of 2026-12-04 ran it: the budget's chunks
    (``forward_rows``), an FP32 ``[V, H]`` buffer zero-filled, then each chunk's
    ``g.t() @ h`` added into it (``out_dtype``, ``out=``) in blocks of ``budget / 4H``
    columns, ``grad_hidden[chunk]`` an FP32 product copied into its buffer."""
    ks, cols = _gif_chunks(budget, T, H, V, FP32), max(1, min(V, budget // (4 * H)))
    ks.append(elementwise("zero-fill FP32 [V, H]", 0, 4 * V * H))
    for r in splits(T, tiling.forward_rows(budget, T, V)):
        ks.append(elementwise("grad_hidden FP32 product -> its buffer", 4 * r * H, 4 * r * H))
        for c in splits(V, cols):
            ks.append(gemm("grad_weight (out_dtype FP32)", c, r, H, out=FP32, acc=True))
    return ks + _scaled(T, H, V)


def _scaled(T: int, H: int, V: int) -> list[Kernel]:
    """The backward's ``(grad * g).to(bf16)`` of both FP32 gradients: traced into the
    compiled backward graph, where Inductor fuses it into one kernel per gradient (read
    on the CPU: one ``cpp_fused__to_copy_mul`` kernel, no FP32 temporary)."""
    n = (T + V) * H
    scaled = elementwise("backward: gradients x g, rounded to bf16 (one fused kernel)", 4 * n, 2 * n)
    return [dataclasses.replace(scaled, fresh=fresh(2 * T * H) + fresh(2 * V * H))]


def gif_two_sweeps(budget: int, T: int, H: int, V: int, kind: str = "cuda", by_device: bool = True
                   ) -> list[Kernel]:
    """``lm_head_loss``, ``two_sweeps``: ``grad_hidden`` in the forward; on a CPU (unit
    incoming gradient, read with ``.item()``) one vocabulary sweep for ``grad_weight`` in
    the backward: 4 GEMMs; elsewhere (no host read of ``g``) the backward recomputes
    both gradients, a sweep each: 6 GEMMs (``loss._sweeps_backward``)."""
    ks = _gif_chunks(budget, T, H, V, BF16)
    if kind != "cpu":
        return ks + two_sweeps(budget, T, H, V)
    for c in splits(V, tiling.sweep_sizes(budget, T, V)[1]):
        ks += tile("recompute block", T, c, H, True) + [gemm("grad_weight", c, T, H, sweep=True)]
    return ks + [elementwise("backward: grad_hidden clone", 2 * T * H, 2 * T * H, new=2 * T * H)]


BACKWARDS: dict[str, Callable] = {"gpu": gpu, "blocks": blocks, "two_sweeps": two_sweeps,
                                  "fp32_tiles": lambda b, T, H, V: blocks(b, T, H, V, fp32=True)}
GIF: dict[str, Callable] = {"gpu": gif_gpu, "two_sweeps": gif_two_sweeps}
GIF_2026_12_04: dict[str, Callable] = {"gpu": gif_gpu_2026_12_04, "two_sweeps": gif_two_sweeps}  # as measured


def ours(T: int, H: int, V: int, plan: str, in_forward: bool, budget: int,
         kind: str = "cuda", gif: Optional[dict] = None, by_device: bool = True) -> list[Kernel]:
    """chunked_logits' kernels; ``kind``: the device's (``Device.kind``); ``gif``: the
    loss-in-graph loops (``GIF``: as built; ``GIF_2026_12_04``: as measured then);
    ``by_device``: ``budget`` is the device's (else one the user set)."""
    if not H:  # W3: row_stats over the given logits
        return [elementwise("forward row reduction", 2 * T * V, exps=T * V),
                elementwise("backward pointwise", 2 * T * V, 2 * T * V, exps=T * V, new=2 * T * V)]
    if in_forward:
        loops = (gif or GIF)[plan](budget, T, H, V, kind, by_device)
        return loops + _outputs(T, H, V, 4 if plan == "gpu" else 2)
    return forward_loop(budget, T, H, V) + BACKWARDS[plan](budget, T, H, V) + _outputs(T, H, V, 2)


def _outputs(T: int, H: int, V: int, size: int) -> list[Kernel]:
    """The gradients' own buffers (the loops write them in place: only their allocation
    costs, where it is ``fresh``)."""
    return [Kernel("gradient buffers", fresh=fresh(size * T * H) + fresh(size * V * H))]


# A device sync's price (the one host read of ``kernels/rows.select``): the GPU drains its
# queue, then idles while the op's Python prologue runs before the next kernel.  An
# assumption (tens to hundreds of microseconds), not measured: docs/gpu.md.
SYNC_S = 100e-6


def masked(T: int, H: int, V: int, plan: str, budget: int, fraction: float, kind: str = "cuda",
           in_forward: bool = True, gif: Optional[dict] = None) -> list[Kernel]:
    """``lm_head_loss`` (``in_forward``; else the per-token ``lm_head_stats_masked``) with
    ``fraction`` of the rows left out of the loss (section 5c of docs/how-it-works.md): the
    logits' bound (a read of ``[T, H]`` and ``[V, H]``), the gather of the kept rows, the
    loop on them (their count rounded up to the granule), the scatter of ``grad_hidden``,
    and the one host read."""
    n = min(T, -(-round(T * (1 - fraction)) // tiling.granule(T)) * tiling.granule(T))
    size = 4 if plan == "gpu" and in_forward else 2
    ks = [elementwise("bound: |h| per row, max |W|", 2 * (T + V) * H),
          elementwise("gather kept rows", 2 * n * H, 2 * n * H)]  # (the host read: SYNC_S)
    if in_forward:
        ks += (gif or GIF)[plan](budget, n, H, V, kind) if n else []
    else:
        ks += forward_loop(budget, n, H, V) + BACKWARDS[plan](budget, n, H, V) if n else []
    ks += [elementwise("scatter grad_hidden (zeros + kept rows)", size * n * H, size * T * H)]
    return ks + _outputs(T, H, V, size)


def masked_table(fractions: list[float], dev: Optional[Device] = None) -> str:
    """Ours / stock, cross-entropy with the lm_head in the graph (``gpu`` plan, the
    device's budget) at T 16384, H 4096, V 151936 on ``dev`` (the H200), by the share of
    rows the loss leaves out (stock computes every row)."""
    dev = dev or DEVICES[-1]
    T, H, V = BUDGET_SHAPE
    base, budget = step_time(stock(T, H, V, "ce"), dev), device_budget(dev)
    every = step_time(ours(T, H, V, "gpu", True, budget), dev) / base
    lines = [f"{dev.name}, T {T}, H {H}, V {V}, plan gpu, loss in graph, ours / stock (every row: "
             f"{every:.2f}x; a host read priced {SYNC_S * 1e6:.0f} us):", "",
             "| rows masked | ours / stock | full GEMMs (stock 3) |", "| --- | --- | --- |"]
    for f in fractions:
        ks = masked(T, H, V, "gpu", budget, f)
        ratio = (step_time(ks, dev) + SYNC_S) / base
        lines.append(f"| {f:.0%} | {ratio:.2f}x | {full_gemms(ks, T, H, V):.2f} |")
    return "\n".join(lines)


def device_budget(dev: Device) -> int:
    """The lm_head loop's budget on ``dev`` when none is configured (``tiling.device_budget``)."""
    fn = getattr(tiling, "device_budget", None)
    return fn(dev.kind, dev.total_bytes) if fn else 32 * MIB


BUDGET_SHAPE = (16384, 4096, 151936)  # (T, H, V) of issue 35's budget table


def budget_table(budgets_mib: Optional[list[float]] = None, dev: Optional[Device] = None) -> str:
    """Ours / stock (cross-entropy with the lm_head in the graph, the ``gpu`` plan) at T
    16384, H 4096, V 151936 on ``dev`` (the H200): the loss in the graph and per-token,
    at the device's default budget and at smaller user-set ones."""
    dev = dev or DEVICES[-1]
    T, H, V = BUDGET_SHAPE
    default = device_budget(dev)
    budgets = [default] + [int(m * MIB) for m in (budgets_mib or [1024, 512, 256, 128, 32])]
    base = step_time(stock(T, H, V, "ce"), dev)
    lines = [f"{dev.name}, T {T}, H {H}, V {V}, plan gpu, ours / stock:", "",
             "| budget | loss loop rows | per-token forward rows | loss in graph | per-token |",
             "| --- | --- | --- | --- | --- |"]
    for b in budgets:
        gif, per = (step_time(ours(T, H, V, "gpu", g, b, by_device=b == default), dev) / base
                    for g in (True, False))
        name = f"{b / MIB:.0f} MiB" + (" (default)" if b == default else "")
        rows = tiling.gpu_loss_rows(b, T, V, b == default)
        lines.append(f"| {name} | {rows} | {tiling.forward_rows(b, T, V)} | {gif:.2f}x | {per:.2f}x |")
    return "\n".join(lines)


# --- the table --------------------------------------------------------------------------

def parse_plans(text: Optional[str], available: Optional[tuple] = None) -> tuple[list[str], list[str]]:
    """(plans to model, notes): ``text`` a comma list (None: all modelled); a plan this
    checkout's ``Config`` does not know (``available``) is left out with a note."""
    names = [p.strip() for p in (text or ",".join(PLANS)).split(",") if p.strip()]
    unknown = [p for p in names if p not in PLANS]
    if unknown:
        raise ValueError(f"unknown plan(s) {unknown}: the cost model has {', '.join(PLANS)}")
    if available is None:
        try:
            from fx_passes.config import LM_HEAD_PLANS as available
        except ImportError:
            available = PLANS
    notes = [f"plan {p!r}: not in this checkout's Config.lm_head_plan, left out" for p in names
             if p not in available]
    return [p for p in names if p in available], notes


def cases(plans: list[str]) -> list[tuple[str, Optional[str], bool]]:
    """(workload, plan or None for W3, gradients in forward) of each table row."""
    out = [("W3", None, False)]
    for name in ("W4", "W4L", "WV", "W4L-8k", "WV-8k"):
        for plan in plans:
            if plan in GIF:
                out.append((name, plan, True))
            out.append((name, plan, False))
    return out


def predict(devices, plans: list[str]) -> list[dict]:
    """A row per case: each device's stock and ours (ms) and ratio, GEMMs, GB moved, the
    target and whether it is met (on the last device); ``error`` where a plan's sizes
    cannot be computed on this checkout (the other rows stand)."""
    rows = []
    for name, plan, in_forward in cases(plans):
        T, H, V, loss = WORKLOADS[name]
        row = {"workload": name, "plan": plan or "-", "path": _path(H, in_forward)}
        base = stock(T, H, V, loss)
        try:
            for dev in devices:
                ks = ours(T, H, V, plan, in_forward, device_budget(dev))
                row[dev.name] = {"stock_ms": 1e3 * step_time(base, dev), "ours_ms": 1e3 * step_time(ks, dev)}
                row[dev.name]["ratio"] = row[dev.name]["ours_ms"] / row[dev.name]["stock_ms"]
        except (AttributeError, TypeError, ValueError) as e:  # e.g. a tiling function this checkout lacks
            rows.append({**row, "error": f"{type(e).__name__}: {e}", "target": None, "met": None})
            continue
        row["gemms"] = (full_gemms(ks, T, H, V, BF16), full_gemms(ks, T, H, V, FP32)) if H else (0.0, 0.0)
        row["gb"] = (moved_bytes(base) / GB, moved_bytes(ks) / GB)
        bound = TARGETS.get((name, in_forward)) if plan == "gpu" else None
        row["target"] = bound
        row["met"] = None if bound is None else row[devices[-1].name]["ratio"] <= bound
        rows.append(row)
    return rows


def _path(H: int, in_forward: bool) -> str:
    if not H:
        return "row_stats"
    return "loss in graph: grads in forward" if in_forward else "per-token: recompute"


def table(rows: list[dict], devices) -> str:
    names = [d.name for d in devices]
    head = ["workload", "plan", "path", "GEMMs bf16 / fp32", "GB stock / ours"]
    head += [f"{n} stock / ours ms" for n in names] + [f"{n} ratio" for n in names] + ["target", ""]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        if "error" in r:
            cells = [r["workload"], r["plan"], r["path"], f"not modelled: {r['error']}"]
            lines.append("| " + " | ".join(cells + [""] * (len(head) - 4)) + " |")
            continue
        cells = [r["workload"], r["plan"], r["path"], "%.2f / %.2f" % r["gemms"], "%.1f / %.1f" % r["gb"]]
        cells += ["%.2f / %.2f" % (r[n]["stock_ms"], r[n]["ours_ms"]) for n in names]
        cells += ["%.2fx" % r[n]["ratio"] for n in names]
        if r["target"] is None:
            cells += ["-", ""]
        else:
            cells += [f"<= {r['target']}x ({names[-1]})", "met" if r["met"] else "**not met**"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(dev: Device) -> str:
    rates = (f"bf16 {dev.flops[BF16] / 1e12:.3g} TFLOPS, FP32 {dev.flops[FP32] / 1e12:.3g} TFLOPS, "
             f"{dev.bandwidth / 1e12:.3g} TB/s, exp {dev.exps / 1e12:.3g} T/s")
    if math.isfinite(dev.first_touch):
        rates += f", first touch {dev.first_touch / 1e9:.3g} GB/s"
    return (f"{dev.name}: {rates}, {dev.launch_s * 1e6:.0f} us a kernel, chunk budget "
            f"{device_budget(dev) / MIB:.0f} MiB ({dev.source})")


def report(plans_text: Optional[str] = None) -> str:
    """The H100 / H200 table as Markdown, with its assumptions (what gpu_check prints)."""
    plans, notes = parse_plans(plans_text)
    rows = predict(DEVICES, plans)
    out = ["Predicted (a model, not a measurement: benchmarks/cost_model.py), ratio = ours / stock:", ""]
    out += [table(rows, DEVICES), ""] + [f"* {describe(d)}" for d in DEVICES]
    out += [f"* note: {n}" for n in notes]
    return "\n".join(out)


def what_ifs(dev: Device = DEVICES[-1]) -> str:
    """The ``gpu`` plan's loss path as built, and with ``grad_weight`` one GEMM (no FP32
    accumulator traffic) and the backward's scaling free; both paths at a 32 MiB budget
    instead of the device's."""
    lines = [f"What-ifs on the {dev.name}, ours / stock:"]
    for name in ("W4", "WV"):
        T, H, V, loss = WORKLOADS[name]
        base, built = step_time(stock(T, H, V, loss), dev), ours(T, H, V, "gpu", True, device_budget(dev))
        floor = [k for k in built if "backward" not in k.what and "grad_weight" not in k.what]
        small = [step_time(ours(T, H, V, "gpu", gif, 32 * MIB, by_device=False), dev) / base
                 for gif in (True, False)]
        best = step_time(floor + [gemm("grad_weight", V, T, H)], dev) / base
        lines.append(f"* {name}: loss in graph as built {step_time(built, dev) / base:.2f}x, grad_weight one "
                     f"GEMM and the scaling free {best:.2f}x; at 32 MiB: loss in graph {small[0]:.2f}x, "
                     f"per-token {small[1]:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plans", default=None, help=f"comma list of {', '.join(PLANS)} (default: all)")
    p.add_argument("--what-if", action="store_true", help="the gpu plan's loss path without its overheads")
    p.add_argument("--budgets", nargs="*", type=float, default=None, metavar="MIB",
                   help="ratios at the default chunk budget and these (default 1024 512 256 128 32), H200")
    p.add_argument("--masked", nargs="*", type=float, default=None, metavar="FRACTION",
                   help="ratios by the share of rows the loss leaves out (default 0 0.25 0.5 0.75), H200")
    args = p.parse_args(argv)
    if args.masked is not None:
        print(masked_table(args.masked or [0.0, 0.25, 0.5, 0.75]))
        return 0
    if args.budgets is not None:
        print(budget_table(args.budgets or None))
        return 0
    print(report(args.plans))
    if args.what_if:
        print("\n" + what_ifs())
    return 0


if __name__ == "__main__":
    sys.exit(main())
