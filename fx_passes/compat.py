"""The private torch APIs this package uses: each checked once, here, with the torch it needs.

Supported: torch >= 2.11, < 2.15 (pyproject.toml).  Where an API is missing, the feature
that needs it is off and the ``fx_passes`` log says so once, at import; nothing else in
the package touches these names directly.  See NOTE [private APIs] for each API, who uses
it and what happens without it.
"""

# NOTE [private APIs]
# ==================================================  =======  ====================================
# API (who uses it)                                   torch    without it
# ==================================================  =======  ====================================
# ``torch._C._log_api_usage_once`` (graph_ops:        all      the telemetry call a loss module
# a telemetry call is not a side effect)                       makes when built inside the compiled
#                                                              code counts as a side effect
#                                                              (such regions are declined)
# Inductor ``unsafe_marked_cacheable_functions``      >= 2.8   rewritten graphs are not stored in
# (backend, install: warm starts)                              AOTAutograd's cache (cold starts)
# Inductor ``pre_grad_pass_timing`` (install: run     >= 2.12  nothing to do: before 2.12 pre-grad
# pre-grad passes before the cache lookup)                     passes always run before the lookup
# ``custom_graph_pass.get_custom_graph_passes``,      >= 2.13  install() cannot chain with a user's
# lists in ``pre_grad_custom_pass`` (install)                  own pre-grad pass: it leaves theirs
#                                                              and is not installed (the backend
#                                                              works)
# ``torch._dynamo.exc.RestartAnalysis``               all      -
# (containment: a restart is not a failure)
# Dynamo's ``_dynamo*`` node attributes, e.g.          all      nothing to copy
# placeholders' ``_dynamo_source`` (passes._copy)
# ``torch.cpu._is_avx512_bf16_supported``,            all      the lm_head backward runs FP32
# ``_is_amx_tile_supported``,                                  GEMMs on every CPU (slower where
# ``_is_amx_fp16_supported`` (tiling.backward_plan)            the CPU multiplies bf16 in hardware)
# ``torch._C._AutoDispatchBelowADInplaceOrView``      all      the lm_head loop bodies run under
# (lm_head loop bodies: one dispatch-key set)                  no_grad only (may compile again
#                                                              when the op is called with other
#                                                              dispatch keys)
# ``aten::mm.dtype`` / ``aten::addmm.dtype`` kernels  >= 2.8   the lm_head backward's "gpu" plan
# for the device (CUDA, XPU; tiling.backward_plan)    CUDA     is not picked: "blocks" (an FP32
#                                                              GEMM for ``grad_hidden``)
# ``addmm(.., out_dtype=float32, out=acc)`` with an   newer    ``acc += mm(.., out_dtype)``: one
# FP32 ``acc`` (gpu_plan: accumulate in place)        than 2.8 FP32 ``[S, H]`` temporary per block
# ``torch.cuda`` / ``torch.xpu``                      all      the chunk loops' default budget
# ``get_device_properties`` (tiling.device_budget)             is 256 MiB on that device
# ==================================================  =======  ====================================

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterator, Optional

import torch
import torch._dynamo.exc
import torch._inductor.config as inductor_config
import torch._inductor.custom_graph_pass as custom_graph_pass

__all__ = ["TELEMETRY_FUNCTIONS", "CACHEABLE_MARKS", "PRE_GRAD_PASS_TIMING", "PASS_LISTS",
           "CONTROL_FLOW_ERRORS", "custom_graph_passes", "dynamo_node_attributes",
           "below_autograd_no_grad", "cpu_matmul_in_hardware", "gemm_out_dtype", "addmm_fp32_",
           "total_device_bytes", "probe_addmm_into", "available", "without_saved_tensors_hooks"]

log = logging.getLogger("fx_passes")


def _check(available: bool, what: str, needs: str, without: str) -> bool:
    if not available:
        log.info("chunked_logits: torch %s has no %s (needs torch %s): %s",
                 torch.__version__, what, needs, without)
    return available


def _has_config(name: str) -> bool:
    return hasattr(inductor_config, name)


_LOG_API_USAGE = getattr(torch._C, "_log_api_usage_once", None)
_check(_LOG_API_USAGE is not None, "torch._C._log_api_usage_once", ">= 2.11",
       "graphs that log API usage inside a region are declined")
# Calls whose only effect is telemetry (graph_ops.is_pure).
TELEMETRY_FUNCTIONS: tuple[Any, ...] = (_LOG_API_USAGE,) if _LOG_API_USAGE is not None else ()

CACHEABLE_MARKS: bool = _check(
    _has_config("unsafe_marked_cacheable_functions"), "Inductor config unsafe_marked_cacheable_functions",
    ">= 2.8", "rewritten graphs are not stored in AOTAutograd's cache")

# Before 2.12 pre-grad passes always ran before the cache lookup, which is what install()
# asks for with "early": nothing is missing there, so this is not logged.
PRE_GRAD_PASS_TIMING: bool = _has_config("pre_grad_pass_timing")

_GET_PASSES = getattr(custom_graph_pass, "get_custom_graph_passes", None)
PASS_LISTS: bool = _check(
    _GET_PASSES is not None, "lists of pre_grad_custom_pass", ">= 2.13",
    "install() does not chain with a user's own pre-grad pass (use backend='chunked_logits')")

_RESTART = getattr(torch._dynamo.exc, "RestartAnalysis", None)
_check(_RESTART is not None, "torch._dynamo.exc.RestartAnalysis", ">= 2.11",
       "no Dynamo restart to let through")
# Exceptions that are Dynamo's control flow, never a failure of the pass.
CONTROL_FLOW_ERRORS: tuple[type, ...] = (_RESTART,) if _RESTART is not None else ()

_AUTO_DISPATCH = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None)
_check(_AUTO_DISPATCH is not None, "torch._C._AutoDispatchBelowADInplaceOrView", ">= 2.11",
       "the lm_head loop bodies run under no_grad only")


def custom_graph_passes(value: Any) -> tuple[Any, ...]:
    """The passes in an Inductor custom-pass setting (None, one pass, or a list/tuple)."""
    if _GET_PASSES is not None:
        return tuple(_GET_PASSES(value))
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


# Dynamo hangs its own attributes on graph nodes (placeholders' ``_dynamo_source``,
# which AOTAutograd asserts); a copy of a graph must keep them.
DYNAMO_ATTRIBUTE_PREFIX = "_dynamo"


def dynamo_node_attributes(node: torch.fx.Node) -> dict[str, Any]:
    """What Dynamo attached to ``node`` (empty when this torch attaches nothing)."""
    return {k: v for k, v in vars(node).items() if k.startswith(DYNAMO_ATTRIBUTE_PREFIX)}


@contextlib.contextmanager
def below_autograd_no_grad() -> Iterator[None]:
    """``torch._C._AutoDispatchBelowADInplaceOrView()`` plus ``torch.no_grad()``: one
    dispatch-key set and one grad mode, so a compiled loop body (lm_head) that is called
    from inside a custom op compiles once, whatever keys and mode its caller has."""
    with contextlib.ExitStack() as stack:
        if _AUTO_DISPATCH is not None:
            stack.enter_context(_AUTO_DISPATCH())
        stack.enter_context(torch.no_grad())
        yield


@contextlib.contextmanager
def without_saved_tensors_hooks() -> Iterator[None]:
    """The user's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``,
    ``save_on_cpu``, activation offloading) set aside while a chunk body runs: a body's
    temporaries live only within its call, and ``torch.func.vjp`` (the row-local and
    vocab-parallel backward bodies) refuses to run under such hooks at all."""
    autograd = torch._C._autograd
    top = getattr(autograd, "_top_saved_tensors_default_hooks", None)
    hooks = []
    while top is not None and (pair := top(True)) is not None:
        hooks.append(pair)
        autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(hooks):
            autograd._push_saved_tensors_default_hooks(pack, unpack)


# CPU features torch reads itself (``torch.cpu._is_*_supported``), for the lm_head
# backward's plan (``tiling.backward_plan``).  oneDNN picks its bf16 kernels from the CPU,
# not from ATEN_CPU_CAPABILITY, so that setting does not change the answer.
_CPU_FEATURES = {
    torch.bfloat16: ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
    torch.float16: ("_is_amx_fp16_supported",),
}


@functools.lru_cache(None)
def cpu_matmul_in_hardware(dtype: torch.dtype) -> bool:
    """Does this CPU multiply ``dtype`` matrices in hardware (bf16: AVX-512 BF16 or AMX;
    fp16: AMX-FP16)?  Without it a model-precision GEMM runs several times slower than
    an FP32 one.  False where this torch cannot tell."""
    checks = [getattr(torch.cpu, name, None) for name in _CPU_FEATURES.get(dtype, ())]
    return any(check() for check in checks if check is not None)


# The dispatch key of each device type whose out_dtype GEMM kernels the "gpu" plan uses.
_DISPATCH_KEYS = {"cuda": "CUDA", "xpu": "XPU", "cpu": "CPU"}
_OUT_DTYPE_OPS = ("aten::mm.dtype", "aten::addmm.dtype")


def gemm_out_dtype(device_type: str) -> bool:
    """Has this build ``aten::mm.dtype`` and ``aten::addmm.dtype`` kernels (model-precision
    inputs, FP32 output: ``torch.mm(a, b, out_dtype=torch.float32)``) for ``device_type``?
    CUDA and XPU since torch 2.8; a CPU only while ``fx_passes.testing.gemms`` registers
    its test kernels (so it is not cached)."""
    key = _DISPATCH_KEYS.get(device_type)
    has = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    return key is not None and has is not None and all(has(op, key) for op in _OUT_DTYPE_OPS)


# Per device type: does
# ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` take an FP32 ``acc`` with
# model-precision ``a``, ``b``?  torch 2.8's CUDA kernel asked for ``self`` in the inputs' dtype.
_ADDMM_INTO: dict[str, bool] = {}


def _addmm_into(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    kind = acc.device.type
    if kind == "cpu":  # only fx_passes.testing.gemms's kernels, which take it
        return gemm_out_dtype(kind)
    if kind not in _ADDMM_INTO and not _capturing(kind):  # (probed when the plan was chosen)
        probe_addmm_into(acc.device, a.dtype)
    return _ADDMM_INTO.get(kind, False)  # (unprobed inside a capture: add a product, always right)


def _capturing(kind: str) -> bool:
    """Is the current stream of device type ``kind`` capturing a CUDA graph?"""
    module = getattr(torch, kind, None)
    available = getattr(module, "is_available", None)
    check = getattr(module, "is_current_stream_capturing", None)
    return bool(available and check and available() and check())


def probe_addmm_into(device: torch.device, dtype: torch.dtype) -> bool:
    """Run the ``addmm(out_dtype=, out=)`` probe on ``device`` once, where the plan is
    chosen (compile time, outside any step and any CUDA graph capture: it reads its
    result back); a step then only looks the answer up."""
    kind = device.type
    if kind == "cpu" or kind in _ADDMM_INTO:
        return _ADDMM_INTO.get(kind, gemm_out_dtype(kind))
    if _capturing(kind):  # (not cached: the next call outside a capture probes)
        return False
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        try:
            one = torch.ones(1, 1, dtype=dtype, device=device)
            probe = torch.zeros(1, 1, dtype=torch.float32, device=device)
        except (RuntimeError, AssertionError):  # (no such device in this process: nothing to probe)
            return False
        try:
            torch.addmm(probe, one, one, out_dtype=torch.float32, out=probe)
            works = probe.item() == 1.0
        except (RuntimeError, TypeError, NotImplementedError):
            works = False
    _check(works, "addmm(out_dtype=float32, out=<FP32 self>) on " + kind, "newer than 2.8",
           "the lm_head 'gpu' plan adds each block's FP32 product into its accumulator")
    _ADDMM_INTO[kind] = works
    return works


def addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` for an FP32 ``acc`` and model-precision ``a``, ``b``: one GEMM with
    model-precision inputs and an FP32 output (``out_dtype``), no FP32 copy of an operand."""
    if _addmm_into(acc, a, b):
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.add_(torch.mm(a, b, out_dtype=torch.float32))


@functools.lru_cache(None)
def _total_bytes(device_type: str, index: Optional[int]) -> Optional[int]:
    module = getattr(torch, device_type, None)
    props = getattr(module, "get_device_properties", None)
    if props is None or not module.is_available():
        return None
    return int(props(index if index is not None else module.current_device()).total_memory)


def total_device_bytes(device: torch.device) -> Optional[int]:
    """The device's total memory (read once per device: no sync, the same on every step);
    None on a CPU or where torch cannot tell."""
    if device.type not in ("cuda", "xpu"):
        return None
    return _total_bytes(device.type, device.index)


def available() -> dict[str, bool]:
    """Each check's answer on this torch (what the table above says is missing where)."""
    return {
        "log_api_usage_once": bool(TELEMETRY_FUNCTIONS),
        "unsafe_marked_cacheable_functions": CACHEABLE_MARKS,
        "pre_grad_pass_timing": PRE_GRAD_PASS_TIMING,
        "pre_grad_pass_lists": PASS_LISTS,
        "restart_analysis": bool(CONTROL_FLOW_ERRORS),
        "auto_dispatch_below_autograd": _AUTO_DISPATCH is not None,
        "cpu_matmul_features": all(hasattr(torch.cpu, name) for names in _CPU_FEATURES.values()
                                   for name in names),
    }


def is_dtensor(value: Any) -> bool:
    """A DTensor (``torch.distributed.tensor``), fake or real; False where torch has no
    distributed support."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(value, DTensor)
