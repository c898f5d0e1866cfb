"""A kernel's time on a device, the cost model's unit (``benchmarks/cost_model.py``).

A kernel takes ``max(GEMM FLOPs / rate(input dtype), bytes / bandwidth, exps / exp rate)``
(a roofline) plus a launch overhead, a step the sum over its kernels; a device calibrated on
a measured run (``CALIBRATION``) prices a GEMM's main loop at a share of the datasheet's rate
plus its output traffic.  ``Device``: the H100 / H200 datasheets (``DEVICES``; this CPU's:
``cost_calibrate.py``); ``Kernel``: what one moves and computes; ``gemm`` / ``elementwise``
make them, ``step_time`` prices a list.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import sys
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fx_passes.kernels import tiling  # noqa: E402

GB, MIB = 1e9, 2**20
REUSED_BYTES = 32 * MIB
BF16, FP32 = "bf16", "fp32"
SIZE = {BF16: 2, FP32: 4}


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


def gemm(what: str, shape: tuple[int, int, int], dtype: str = BF16, out: str = BF16, acc: bool = False,
         new: bool = False, sweep: bool = False) -> Kernel:
    """``[m, k] x [k, n]`` (``shape``: ``(m, k, n)``, as ``Kernel.shape``): its operands read
    once, its output written (and read: ``acc``); ``new``: the output is a buffer of its own
    (``fresh``); ``sweep``: a GEMM of a backward recompute sweep."""
    m, k, n = shape
    s, out_io = SIZE[dtype], SIZE[out] * m * n * (2 if acc else 1)
    new_bytes = fresh(SIZE[out] * m * n) if new else 0.0
    io = s * (m * k + k * n) + out_io
    return Kernel(what, 2.0 * m * k * n, dtype, io, 0.0, 1, (m, k, n), new_bytes, out_io, sweep)


def elementwise(what: str, read: float, write: float = 0.0, exps: float = 0.0, count: int = 1,
                new: float = 0.0) -> Kernel:
    """``new``: the bytes of its output that are a buffer of its own (``fresh``)."""
    return Kernel(what, 0.0, BF16, read + write, exps, count, (), fresh(new))


def full_gemms(kernels: list[Kernel], T: int, H: int, V: int, dtype: Optional[str] = None) -> float:
    """GEMM FLOPs in units of one ``[T, H] x [H, V]`` (``dtype``: inputs of that dtype only)."""
    return sum(k.n * k.flops for k in kernels if dtype in (None, k.dtype)) / (2.0 * T * H * V)


def moved_bytes(kernels: list[Kernel]) -> float:
    return sum(k.n * k.bytes for k in kernels)



def device_budget(dev: Device) -> int:
    """The lm_head loop's budget on ``dev`` when none is configured (``tiling.device_budget``)."""
    fn = getattr(tiling, "device_budget", None)
    return fn(dev.kind, dev.total_bytes) if fn else 32 * MIB
