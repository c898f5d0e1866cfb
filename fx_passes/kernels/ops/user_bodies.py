"""Compiled bodies made of the user's own ops: a vocab-parallel stage's reductions
(:mod:`fx_passes.distributed.shard_stages`) and a row-local region
(:mod:`fx_passes.kernels.row_local.engine`).

Each is an FX graph ``fn(*inputs) -> tuple`` (the region's own ops replayed), registered
under a key that the rewritten graph passes to its custom op.  Here each key's forward
and vector-Jacobian product are compiled by Inductor once (:mod:`fx_passes.kernels.ops.body_compiler`:
fused kernels that read the model-precision logits, no FP32 ``[.., V]`` buffer; eagerly
if compiling fails, counted as the caller's ``counter``).
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch
from torch.fx import GraphModule
from torch.utils._python_dispatch import TorchDispatchMode

from .body_compiler import compile_body
from .registry import GRAPH_BODIES

__all__ = ["register", "function", "fake_function", "body", "backward_body", "vjp_function"]

# NOTE [fake bodies decompose as ATen does]
# A custom op's fake kernel runs below autograd, so a CompositeImplicitAutograd op of the
# body (``F.nll_loss``'s ``aten.nll_loss``, ``F.cross_entropy``'s) reaches the fake
# mode whole, and with symbolic sizes the fake mode prefers torch's Python decomposition
# table.  Its ``aten.nll_loss`` entry is ``F.nll_loss``'s reference, which reads ATen's
# integer ``reduction`` as ``size_average``: ``reduction='none'`` (0) is taken for a sum,
# a 0-d fake result where the kernel returns one value per row (torch 2.11-2.13), and
# Inductor's size assertion fails the user's compile.  Above autograd, and in the body
# that really runs, such ops decompose in C++; :func:`fake_function` makes them do so here too.

_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd


class _CompositesInCpp(TorchDispatchMode):
    """CompositeImplicitAutograd ops decomposed by their ATen kernel, as above autograd."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "aten" and func.has_kernel_for_dispatch_key(_COMPOSITE):
            with self:  # (the ops it decomposes into: also here first)
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)



def register(gm: GraphModule) -> str:
    """The key of ``gm`` (by its code: the same stage in two graphs shares one body)."""
    key = hashlib.sha256(gm.code.encode()).hexdigest()[:24]
    GRAPH_BODIES.add(key, gm)
    return key


def function(key: str) -> GraphModule:
    """The stage's reductions, uncompiled (fake-tensor shapes, eager fallback)."""
    return GRAPH_BODIES[key]


def fake_function(key: str) -> Callable[..., tuple]:
    """Body ``key`` for the fake tensors of a custom op's fake kernel: its results shaped as
    the real body makes them (see NOTE [fake bodies decompose as ATen does])."""
    fn = GRAPH_BODIES[key]

    def run(*args: torch.Tensor) -> tuple:
        with _CompositesInCpp():
            return tuple(fn(*args))
    return run


def body(key: str, counter: str = "shard_body_eager"):
    """The stage's reductions, compiled by Inductor once per key (fused kernels that read
    the model-precision logits: no FP32 [.., V] buffer)."""
    fn = GRAPH_BODIES[key]

    def reductions(*args):
        return fn(*args)
    return compile_body(("stage", key), reductions, f"body_{key}", counter)


def vjp_function(fn, n: int, wanted: tuple[int, ...], outputs: tuple[int, ...] | None,
                 with_outputs: bool = False):
    """``(*inputs, *grads) -> grads of inputs[i] for i in wanted``: the vector-Jacobian
    product of ``fn`` (``n`` inputs) for the incoming gradients of its results
    ``outputs`` (all when None); ``with_outputs``: those results follow the gradients."""
    def vjp(*args):
        inputs, grads = args[:n], args[n:]

        def partial(*diff):
            full = list(inputs)
            for i, d in zip(wanted, diff):
                full[i] = d
            out = tuple(fn(*full))
            return out if outputs is None else tuple(out[i] for i in outputs)
        out, pullback = torch.func.vjp(partial, *(inputs[i] for i in wanted))
        got = pullback(tuple(grads))
        return (*got, *out) if with_outputs else got
    return vjp


def backward_body(key: str, wanted: tuple[int, ...], outputs: tuple[int, ...] | None = None,
                  counter: str = "shard_body_eager", into: tuple[int | None, ...] | None = None):
    """``(*inputs, *grads) -> grads of inputs[i] for i in wanted``: the vector-Jacobian
    product of the body, compiled once per key (a pointwise pass that writes the logits
    gradient in model precision).  ``grads`` are those of ``outputs`` (positions; all
    outputs when None: a body's integer outputs, such as top-k indices, have none).
    ``into`` (one entry per gradient): ``(*inputs, *grads, *buffers) -> ()`` writes each
    gradient into ``inputs[into[k]]`` (over the input it is the gradient of) or, for
    None, into the next of ``buffers``: the generated kernels store it there, no copy of
    a returned chunk."""
    fn = GRAPH_BODIES[key]
    n = sum(1 for node in fn.graph.nodes if node.op == "placeholder")
    extra = sum(1 for t in into or () if t is None)

    vjp = vjp_function(fn, n, wanted, outputs)

    def vjp_into(*args):
        buffers = iter(args[len(args) - extra:])
        for t, g in zip(into, vjp(*args[:len(args) - extra])):
            (args[t] if t is not None else next(buffers)).copy_(g)
        return ()
    name = f"body_backward{'_into' if into is not None else ''}_{key}_{'_'.join(map(str, wanted))}"
    return compile_body(("vjp", key, wanted, outputs, into), vjp if into is None else vjp_into, name, counter,
                        grad_mode=torch.no_grad)
