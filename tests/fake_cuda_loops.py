"""The ``"gpu"`` plan's chunk loops run on fake CUDA tensors at the sizes of the recorded
H200 run (T 8192, V 151936, H 4096, bf16; a fake tensor holds no memory), with the
budget a CUDA device gets, and every ATen call they make recorded in order (run by
tests/fake_cuda_child.py, which has ``mm.dtype`` / ``addmm.dtype`` registered for the
CUDA key as a CUDA build has them; asserted by tests/test_fake_cuda.py).

* The loss in the graph: the ``lm_head_loss`` call the ``"gpu"`` rewrite emits for a
  cross-entropy (rewritten on small CPU tensors, which registers its tail and final
  bodies; ``skip_masked_rows`` off: choosing the rows to run reads the mask, which a
  fake tensor has no values for), run with fake CUDA tensors of the real sizes through the op's own Python
  (``loss._lm_head_loss``'s function: ``_forward``, ``_loop``,
  ``gpu_plan.fp32_chunk_grads``), then its backward (``loss._setup`` / ``_backward``)
  on a plain context: no dispatcher, no autograd (which aborts on a fake CUDA tensor).
* The per-token backward: ``lm_head_sweeps.lm_head_grads`` (``gpu_plan.out_dtype_blocks``).

What differs from a GPU, and why:
* the chunk bodies run eagerly (``body_compiler.compiling_with``: Inductor cannot make
  CUDA kernels without a CUDA build), so their row kernels show as ATen calls and the
  logits GEMM as ``aten.linear.default`` (Inductor's extern ``mm`` on a GPU);
* ``compat.probe_addmm_into`` runs real CUDA tensors and reads one back: here its answer
  is set as a CUDA build gives it (``True`` on torch newer than 2.8, ``False`` on 2.8);
* ``compat.total_device_bytes`` is set to the device's (``tiling.device_budget``);
* ``addmm(.., out=)`` on a fake tensor takes its meta kernel: its Python decomposition
  copies into ``out`` through ``Tensor.copy_``'s binding (below);
* the Python bindings of ``Tensor.__getitem__``, ``__setitem__``, ``copy_`` and
  ``contiguous`` set a device guard, which raises on this build (no CUDA):
  ``WithoutDeviceGuards`` runs them as the ATen calls the bindings make (``aten.slice`` /
  ``select`` / ``unsqueeze`` views, a full slice being the tensor itself; ``aten.copy_``;
  ``aten.clone`` where not contiguous), which is what is recorded.
"""

from __future__ import annotations

import contextlib
import unittest.mock

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fx_passes import Config, compat
from fx_passes.kernels import tiling
from fx_passes.kernels.log_softmax import loss
from fx_passes.kernels.log_softmax.lm_head_kept import _fill, kept_grads
from fx_passes.kernels.log_softmax.lm_head_sweeps import lm_head_grads
from fx_passes.kernels.ops import body_compiler, registry
from fx_passes.kernels.ops.args import Cotangents, Head, HeadOptions, RowValues
from fx_passes.pipeline import transform
from fx_passes.testing.gemms import cpu_out_dtype_kernels
from tests.helpers import dynamo_graph

T, V, H = 8192, 151936, 4096
SMALL_T, SMALL_V, SMALL_H = 64, 256, 32  # the sizes the rewrite runs at (each size distinct)
SMALL = {SMALL_T: T, SMALL_V: V, SMALL_H: H}
DEVICES = {"h100": 80 * 10**9, "h200": 141 * 10**9}  # total memory (bytes): tiling.device_budget
BF16, F32 = torch.bfloat16, torch.float32


def ce(hidden, weight, labels):
    return F.cross_entropy((hidden @ weight.T).float(), labels)


def _index(t: torch.Tensor, index) -> torch.Tensor:
    """``t[index]`` for basic indices (ints, slices of step 1, None, ``...``) as the
    binding runs it: one ATen view per indexed dim, none for a full slice."""
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        rest = t.dim() - sum(i is not None and i is not Ellipsis for i in index)
        index = index[:at] + (slice(None),) * rest + index[at + 1:]
    dim = 0
    for i in index:
        if i is None:
            t = torch.ops.aten.unsqueeze.default(t, dim)
        elif isinstance(i, int) and not isinstance(i, bool):
            t = torch.ops.aten.select.int(t, dim, i)
            continue
        elif isinstance(i, slice) and i.step in (None, 1):
            start, stop, _ = i.indices(t.shape[dim])
            if (start, stop) != (0, t.shape[dim]):
                t = torch.ops.aten.slice.Tensor(t, dim, start, max(start, stop))
        else:
            raise NotImplementedError(f"index {i!r} of a fake CUDA tensor (tests/fake_cuda_loops.py)")
        dim += 1
    return t


class WithoutDeviceGuards(TorchFunctionMode):
    """``Tensor.__getitem__``, ``__setitem__``, ``copy_`` and ``contiguous`` as the ATen
    calls their Python bindings make, without the device guard those set (see the
    module's docstring); every other call as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__:
            return _index(*args)
        if func is torch.Tensor.__setitem__:
            t, index, value = args
            if isinstance(value, torch.Tensor):
                torch.ops.aten.copy_.default(_index(t, index), value)
            else:
                torch.ops.aten.fill_.Scalar(_index(t, index), value)
            return None
        if func is torch.Tensor.copy_:
            return torch.ops.aten.copy_.default(*args, **kwargs)
        if func is torch.Tensor.contiguous:
            t, fmt = args[0], kwargs.get("memory_format", torch.contiguous_format)
            contiguous = t.is_contiguous(memory_format=fmt)
            return t if contiguous else torch.ops.aten.clone.default(t, memory_format=fmt)
        return func(*args, **kwargs)


class Recorder(TorchDispatchMode):
    """Every ATen call in order (``prim`` queries left out): its overload, its first
    result's shape and dtype, whether that is a view of an input (no kernel: a slice, a
    transpose, a ``.to`` of the same dtype), its inputs' dtypes (``out`` left out), the
    storage it writes through ``out=`` and that view's offset, every storage it reads or
    writes (numbered in order of first sight; each kept alive, so no number is reused)."""

    def __init__(self):
        super().__init__()
        self.ops, self._storages = [], {}

    def storage(self, t: torch.Tensor) -> int:
        s = t.untyped_storage()
        return self._storages.setdefault(s._cdata, (len(self._storages), s))[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":
            return out
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        first = first if isinstance(first, torch.Tensor) else None
        into = kwargs.get("out")
        ins = [t for t in tree_leaves((args, {k: v for k, v in kwargs.items() if k != "out"}))
               if isinstance(t, torch.Tensor)]
        self.ops.append({
            "op": str(func), "shape": list(first.shape) if first is not None else [],
            "view": (first is not None and not func._schema.is_mutable
                     and self.storage(first) in {self.storage(t) for t in ins}),
            "dtype": _name(first.dtype) if first is not None else None,
            "in_dtypes": [_name(t.dtype) for t in ins],
            "writes": self.storage(into) if into is not None else None,
            "offset": into.storage_offset() if into is not None else None,
            "storages": sorted({self.storage(t) for t in tree_leaves((args, kwargs, out))
                                if isinstance(t, torch.Tensor)})})
        return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _emitted_loss_call() -> tuple:
    """(args, kwargs) of the ``lm_head_loss`` call the ``"gpu"`` rewrite emits for ``ce``
    on small CPU tensors (its tail and final bodies registered by the rewrite)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(SMALL_T, SMALL_H, generator=g).to(BF16).requires_grad_()
    weight = torch.randn(SMALL_V, SMALL_H, generator=g).to(BF16).requires_grad_()
    labels = torch.randint(0, SMALL_V, (SMALL_T,), generator=g)
    gm = dynamo_graph(ce, hidden, weight, labels)
    with cpu_out_dtype_kernels():
        new = transform(gm, Config.from_options({"lm_head_plan": "gpu", "skip_masked_rows": False}))
    (call,) = [n for n in new.graph.nodes if n.op == "call_function" and callable(n.target)
               and registry.target_name(n.target) == "fx_passes.kernels.log_softmax.loss.lm_head_loss"]
    return call.args, call.kwargs


def _fake_cuda(mode, node):
    """A fake CUDA tensor like the node's example value, at the real sizes."""
    if not isinstance(node, torch.fx.Node):
        return node
    v = node.meta["example_value"]
    with mode:
        return torch.empty([SMALL.get(int(s), int(s)) for s in v.shape], dtype=v.dtype, device="cuda")


@contextlib.contextmanager
def _meta_out_kernels():
    """``addmm(.., out=)`` on a fake tensor by its meta kernel, not its Python
    decomposition (whose copy into ``out`` goes through ``Tensor.copy_``'s binding)."""
    from torch._decomp import decomposition_table
    ops = [torch.ops.aten.addmm.dtype_out, torch.ops.aten.addmm.out]
    saved = {op: decomposition_table.pop(op) for op in ops if op in decomposition_table}
    try:
        yield
    finally:
        decomposition_table.update(saved)


class _Ctx:
    """What ``loss._setup`` / ``_backward`` read of an autograd context."""

    needs_input_grad = (True, True, False)

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


@contextlib.contextmanager
def cuda_device(total_bytes: int, addmm_into: bool):
    """The device's total memory and the answer of its ``addmm`` probe, as a CUDA build
    of torch gives them (see the module's docstring); the chunk bodies run eagerly."""
    with (unittest.mock.patch.object(compat, "total_device_bytes", lambda device: total_bytes),
          _meta_out_kernels(),
          unittest.mock.patch.dict(compat._ADDMM_INTO, {"cuda": addmm_into}),
          body_compiler.compiling_with(lambda fn, options: fn)):
        yield


def loss_loop(mode, call: tuple, total_bytes: int, addmm_into: bool) -> dict:
    """The loss in the graph: the forward's calls, then the backward's (one recording)."""
    args, kwargs = call
    args = [_fake_cuda(mode, a) for a in args]
    op, got = loss._lm_head_loss, {}

    def run(*inputs):  # the op's own function, called directly
        got["inputs"], got["out"] = inputs, op._init_fn(*inputs)
        return got["out"]
    with cuda_device(total_bytes, addmm_into), torch.no_grad(), mode, WithoutDeviceGuards(), \
            Recorder() as rec:
        with unittest.mock.patch.object(loss, "_lm_head_loss", run):
            loss.lm_head_loss(*args, **kwargs)
        ctx, g = _Ctx(), torch.ones((), dtype=F32, device="cuda")
        forward = len(rec.ops)
        loss._setup(ctx, got["inputs"], got["out"])
        loss._backward(ctx, g)
    sums = {"grad_hidden": rec.storage(got["out"][1]), "grad_weight": rec.storage(got["out"][2])}
    return {"budget": tiling.device_budget("cuda", total_bytes), "forward": rec.ops[:forward],
            "backward": rec.ops[forward:], "sums": sums}


def per_token_blocks(mode, total_bytes: int) -> dict:
    """The per-token backward (``lm_head_grads``, plan ``"gpu"``), recorded."""
    with cuda_device(total_bytes, True), torch.no_grad(), mode, WithoutDeviceGuards():
        hidden = torch.empty(T, H, dtype=BF16, device="cuda")
        weight = torch.empty(V, H, dtype=BF16, device="cuda")
        tokens = torch.empty(T, dtype=torch.int64, device="cuda")
        rows = [torch.empty(T, dtype=F32, device="cuda") for _ in range(3)]
        opts = HeadOptions(True, False, tiling.BY_DEVICE, "", "gpu")
        head = Head(hidden, weight, None, tokens, None)
        with Recorder() as rec:
            got = lm_head_grads(head, RowValues(rows[0]), Cotangents(*rows), opts)
    grads = {"grad_hidden": rec.storage(got[0]), "grad_weight": rec.storage(got[1])}
    return {"budget": tiling.device_budget("cuda", total_bytes), "ops": rec.ops, "grads": grads}


def kept_backward(mode, total_bytes: int) -> dict:
    """The ``"kept_logits"`` backward (``lm_head_kept.kept_grads``) on the forward's kept
    logits, recorded (the chunk body runs eagerly: ``cuda_device``)."""
    with cuda_device(total_bytes, True), torch.no_grad(), mode, WithoutDeviceGuards():
        hidden = torch.empty(T, H, dtype=BF16, device="cuda")
        weight = torch.empty(V, H, dtype=BF16, device="cuda")
        logits = torch.empty(T, V, dtype=BF16, device="cuda")
        tokens = torch.empty(T, dtype=torch.int64, device="cuda")
        rows = [torch.empty(T, dtype=F32, device="cuda") for _ in range(3)]
        opts = HeadOptions(True, False, tiling.BY_DEVICE, "", "kept_logits")
        with Recorder() as rec:
            got = kept_grads(Head(hidden, weight, None, tokens, None), logits, RowValues(rows[0]),
                             Cotangents(*rows), opts)
    grads = {"grad_hidden": rec.storage(got[0]), "grad_weight": rec.storage(got[1])}
    return {"budget": tiling.device_budget("cuda", total_bytes), "ops": rec.ops, "grads": grads,
            "logits": rec.storage(logits)}


def kept_forward(mode, total_bytes: int, transforms: str = "") -> dict:
    """The ``"kept_logits"`` forward (``lm_head_kept._fill``) writing the kept logits,
    recorded (its stats body runs eagerly: ``cuda_device``)."""
    with cuda_device(total_bytes, True), torch.no_grad(), mode, WithoutDeviceGuards():
        hidden = torch.empty(T, H, dtype=BF16, device="cuda")
        weight = torch.empty(V, H, dtype=BF16, device="cuda")
        logits = torch.empty(T, V, dtype=BF16, device="cuda")
        tokens = torch.empty(T, dtype=torch.int64, device="cuda")
        opts = HeadOptions(True, False, tiling.BY_DEVICE, transforms, "auto")
        with Recorder() as rec:
            _fill(Head(hidden, weight, None, tokens, None), opts, logits)
    return {"budget": tiling.device_budget("cuda", total_bytes), "ops": rec.ops,
            "logits": rec.storage(logits)}


SOFTCAP = f"div:{(30.0).hex()},tanh,mul:{(30.0).hex()}"  # (Gemma2's, as lm_head_match writes it)


def run(mode) -> dict:
    """Each loop on each device (and the loss loop with torch 2.8's ``addmm`` answer)."""
    call = _emitted_loss_call()
    return {"loss": {name: loss_loop(mode, call, total, True) for name, total in DEVICES.items()},
            "loss_addmm_2_8": loss_loop(mode, call, DEVICES["h200"], False),
            "per_token": {name: per_token_blocks(mode, total) for name, total in DEVICES.items()},
            "kept": {name: kept_backward(mode, total) for name, total in DEVICES.items()},
            "kept_forward": {name: kept_forward(mode, total) for name, total in DEVICES.items()},
            "kept_forward_softcap": kept_forward(mode, DEVICES["h200"], SOFTCAP)}
