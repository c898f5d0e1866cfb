"""Which matrix multiplications a step runs: the GEMM audit.

``recording()`` is a dispatch mode that records every matmul that reaches ATen (eager
code, the chunk loops' Python, and the extern kernels Inductor's wrappers call): its
operands' shapes and dtypes, the ``out_dtype`` it was asked for, and its FLOPs.
``cpu_out_dtype_kernels()`` registers, for as long as it is open, a CPU kernel for
``aten::mm.dtype`` / ``aten::addmm.dtype`` (CUDA and XPU have them since torch 2.8; the
CPU has none): the FP32 product of the model-precision inputs, which is what the GPU
computes, so that the GPU plans run, and are audited and checked, on any CPU.

Used by the tests and the cost model (``benchmarks/cost_model.py``); nothing in the
pass imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Gemm", "Op", "recording", "tracing", "full_gemms", "cpu_out_dtype_kernels"]


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One ``[m, k] x [k, n]`` product (batched ones count each batch)."""

    op: str  # e.g. "aten.mm.default", "aten.addmm.dtype"
    m: int
    k: int
    n: int
    batch: int
    in_dtype: torch.dtype  # the operands' dtype (the first operand's, which all share)
    out_dtype: torch.dtype

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n


# (operand positions of the two factors) per ATen overload packet
_FACTORS = {
    "mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2),
    "addmm_": (1, 2), "baddbmm_": (1, 2),  # (in place: the FP32 accumulators' acc.addmm_)
    "_int_mm": (0, 1),
}


def _record(func, args, kwargs) -> Optional[Gemm]:
    name = func.overloadpacket.__name__
    if name == "_linear_pointwise" and func.namespace == "mkldnn":  # (X [M, K], a reordered weight [N, K]:
        x, w = args[0], args[1]                                      # kernels/chunk_gemm.py's chunk GEMM)
        return Gemm(str(func), int(x.shape[-2]), int(x.shape[-1]), int(w.shape[0]), 1, x.dtype, x.dtype)
    if name not in _FACTORS:
        return None
    i, j = _FACTORS[name]
    a, b = args[i], args[j]
    out_dtype = kwargs.get("out_dtype")
    if out_dtype is None and func._overloadname.startswith("dtype"):
        out_dtype = args[j + 1]
    batch = a.shape[0] if a.dim() == 3 else 1
    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-1]
    return Gemm(str(func), int(m), int(k), int(n), int(batch), a.dtype, out_dtype or a.dtype)


# Namespaces of the custom ops whose insides are recorded too (the package's).
_OPAQUE = ("chunked_logits",)


def _keys(args, kwargs) -> torch._C.DispatchKeySet:
    """The dispatch keys of the call's tensors (a list argument's too)."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor):
                keys = keys | torch._C._dispatch_keys(t)
    return keys


@dataclasses.dataclass(frozen=True)
class Op:
    """One ATen call a step ran (``tracing``): its overload and its (first) result."""

    op: str  # e.g. "aten.mm.dtype_out"
    shape: tuple
    dtype: Optional[torch.dtype]


def _op(func, result) -> Op:
    out = result[0] if isinstance(result, (tuple, list)) and result else result
    if isinstance(out, torch.Tensor):
        return Op(str(func), tuple(out.shape), out.dtype)
    return Op(str(func), (), None)


class _Recorder(TorchDispatchMode):
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Dynamo runs a compiled function eagerly under a mode that does not say this
        # (so a recorded step would be stock's eager one); with it, the mode is off while
        # compiling and on while the compiled code runs, and sees the ATen calls it makes.
        return True

    def __init__(self) -> None:
        super().__init__()
        self.gemms: list[Gemm] = []
        self.ops: list[Op] = []  # every call, in order (``tracing``)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        g = _record(func, args, kwargs)
        if g is not None:
            self.gemms.append(g)
        if func.namespace in _OPAQUE:
            # A custom op's kernel (the lm_head chunk loops) runs more ops inside, which a
            # mode does not see while it handles the call: run that kernel (below the
            # Python key, so it does not come back here) with the mode on again.
            keys = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)
            with self:
                result = func.redispatch(keys & _keys(args, kwargs), *args, **kwargs)
        else:
            result = func(*args, **kwargs)
        self.ops.append(_op(func, result))
        return result


@contextlib.contextmanager
def recording() -> Iterator[list[Gemm]]:
    """``with recording() as gemms: step()``: ``gemms`` lists every matmul the step ran."""
    mode = _Recorder()
    with mode:
        yield mode.gemms


@contextlib.contextmanager
def tracing() -> Iterator[list[Op]]:
    """``with tracing() as ops: step()``: ``ops`` lists every ATen call the step ran, in
    order (a custom op of the package after the calls inside it; a compiled body's own
    kernels are not ATen calls, its extern GEMMs are), with its result's shape and dtype."""
    mode = _Recorder()
    with mode:
        yield mode.ops


def full_gemms(gemms: list[Gemm], t: int, h: int, v: int, in_dtype: Optional[torch.dtype] = None) -> float:
    """The recorded FLOPs in units of one ``[T, H] x [H, V]`` GEMM (``in_dtype``: only
    the matmuls with inputs of that dtype)."""
    total = sum(g.flops for g in gemms if in_dtype is None or g.in_dtype == in_dtype)
    return total / (2 * t * h * v)


def _mm_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if a.dtype != b.dtype:
        raise RuntimeError(f"mm.dtype: operands differ in dtype ({a.dtype}, {b.dtype})")
    if out_dtype not in (torch.float32, a.dtype):
        raise RuntimeError(f"mm.dtype: out_dtype {out_dtype} must be float32 or the inputs' dtype")
    # exact products of the model-precision inputs, summed in FP32 (the GPU's maths)
    return torch.mm(a.float(), b.float()).to(out_dtype)


def _addmm_dtype(self: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype,
                 beta=1, alpha=1) -> torch.Tensor:
    prod = _mm_dtype(a, b, torch.float32)
    out = prod * alpha if alpha != 1 else prod
    if beta != 0:
        out = out + (self.float() * beta if beta != 1 else self.float())
    return out.to(out_dtype)


def _mm_dtype_out(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, *,
                  out: torch.Tensor) -> torch.Tensor:
    _check_out(out, out_dtype)
    return out.copy_(_mm_dtype(a, b, out_dtype))


def _addmm_dtype_out(self: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, *,
                     beta=1, alpha=1, out: torch.Tensor) -> torch.Tensor:
    # (the product is formed before ``out`` is written: ``out`` may be ``self``, as the
    # GPU kernels allow)
    _check_out(out, out_dtype)
    return out.copy_(_addmm_dtype(self, a, b, out_dtype, beta=beta, alpha=alpha))


def _check_out(out: torch.Tensor, out_dtype: torch.dtype) -> None:
    if out.dtype != out_dtype:
        raise RuntimeError("out_dtype must be the same as the dtype of the provided out tensor")


@contextlib.contextmanager
def cpu_out_dtype_kernels() -> Iterator[None]:
    """CPU kernels for ``aten::mm.dtype`` and ``aten::addmm.dtype`` (and their ``out=``
    forms) while the block runs (test-only: the CPU build of torch has none); a no-op
    where torch already has them."""
    a = torch.zeros(1, 1, dtype=torch.bfloat16)
    try:
        torch.mm(a, a, out_dtype=torch.float32)
        yield  # this build has them
        return
    except (NotImplementedError, RuntimeError):
        pass
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("mm.dtype", _mm_dtype, "CPU")
        lib.impl("addmm.dtype", _addmm_dtype, "CPU")
        lib.impl("mm.dtype_out", _mm_dtype_out, "CPU")
        lib.impl("addmm.dtype_out", _addmm_dtype_out, "CPU")
        yield
    finally:
        lib._destroy()
