"""The compiled bodies of vocab-parallel stages (:mod:`fx_passes.distributed.vocab_parallel`).

A rewritten stage's reductions are an FX graph ``fn(x, *operands) -> tuple`` (the region's
own ops replayed), registered under a key that the rewritten graph passes to the stage's
custom op.  Here each key's forward and vector-Jacobian product are compiled by Inductor
once (:mod:`fx_passes.kernels.compiler`: fused kernels that read the model-precision
logits, no FP32 ``[.., V]`` buffer; eagerly if compiling fails).
"""

from __future__ import annotations

import hashlib

import torch
from torch.fx import GraphModule

from .compiler import compile_body
from .registry import STAGE_FUNCTIONS

__all__ = ["register", "function", "body", "backward_body"]


def register(gm: GraphModule) -> str:
    """The key of ``gm`` (by its code: the same stage in two graphs shares one body)."""
    key = hashlib.sha256(gm.code.encode()).hexdigest()[:24]
    STAGE_FUNCTIONS.add(key, gm)
    return key


def function(key: str) -> GraphModule:
    """The stage's reductions, uncompiled (fake-tensor shapes, eager fallback)."""
    return STAGE_FUNCTIONS[key]


def body(key: str):
    """The stage's reductions, compiled by Inductor once per key (fused kernels that read
    the model-precision logits: no FP32 [.., V] buffer)."""
    fn = STAGE_FUNCTIONS[key]

    def reductions(*args):
        return fn(*args)
    return compile_body(("stage", key), reductions, f"shard_reduce_{key}", "shard_body_eager")


def backward_body(key: str, wanted: tuple[int, ...]):
    """``(*inputs, *grads) -> grads of inputs[i] for i in wanted``, where inputs are
    ``(x, *operands)``: the vector-Jacobian product of the stage's reductions, compiled
    once per key (a pointwise pass that writes the logits gradient in model precision)."""
    fn = STAGE_FUNCTIONS[key]
    n = sum(1 for node in fn.graph.nodes if node.op == "placeholder")

    def vjp(*args):
        inputs, grads = args[:n], args[n:]

        def partial(*diff):
            full = list(inputs)
            for i, d in zip(wanted, diff):
                full[i] = d
            return tuple(fn(*full))
        _, pullback = torch.func.vjp(partial, *(inputs[i] for i in wanted))
        return pullback(tuple(grads))
    name = f"shard_reduce_backward_{key}_{'_'.join(map(str, wanted))}"
    return compile_body(("vjp", key, wanted), vjp, name, "shard_body_eager", grad_mode=torch.no_grad)
