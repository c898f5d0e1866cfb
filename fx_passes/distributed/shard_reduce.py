"""The op one stage of a vocab-parallel region becomes (lm_head not fused):
:func:`shard_reduce` runs the stage's reductions over this rank's shard, recomputing the
elementwise ops from the model-precision logits, and its backward writes the logits
gradient in model precision in one pass (local: no collective).  :func:`_build` makes a
stage's body from the region.  See NOTE [vocab-parallel stages] in
``distributed/shard_stages.py``.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import Graph, GraphModule, Node

from ..fx.graph_ops import get_arg, meta, requires_grad, tensor_input
from ..kernels.ops import user_bodies
from ..kernels.ops.args import grads_by_name
from ..kernels.ops.pair import call_by_name, grads_or_zeros, keep_result_specs, save_inputs, saved_inputs
from ..kernels.ops.registry import CAPTURE_SAFE, emitted
from .shard_regions import ShardRegion, cone, needs_grad, reduction_kind

__all__ = ["shard_reduce"]


def _build(region: ShardRegion, reductions: list[Node], operands: list[Node]) -> GraphModule:
    """``fn(x, *operands) -> tuple(reductions)``: the region's ops for these reductions,
    a gather spelled as a masked sum, values computed without grad marked detached."""
    g = Graph()
    env: dict[Node, Node] = {region.x: g.placeholder("x")}
    for i, o in enumerate(operands):
        env[o] = g.placeholder(f"operand{i}")
    nodes: list[Node] = []
    for r in reductions:
        nodes += [n for n in cone(region, r) if n not in nodes]
    order = {n: i for i, n in enumerate(region.upcast.graph.nodes)}
    differentiable = any(needs_grad(r) for r in reductions)
    for n in sorted(nodes, key=order.__getitem__):
        if reduction_kind(n) == "gather":
            src, index = env[tensor_input(n)], env[get_arg(n, "index")]
            width = g.call_method("size", (src, -1))  # (read at run time: a block of columns too)
            ar = g.call_function(torch.arange, (width,), {"device": meta(n).device})
            hit = g.call_function(operator.eq, (ar, index))
            picked = g.call_function(torch.where, (hit, src, 0.0))
            env[n] = g.call_method("sum", (picked, -1), {"keepdim": True})
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
            no_grad = not requires_grad(n) and requires_grad(region.x)
            if differentiable and n is not region.upcast and no_grad:  # computed without grad
                env[n] = g.call_method("detach", (env[n],))
    g.output(tuple(env[r] for r in reductions))
    return GraphModule(torch.nn.Module(), g)


@torch.library.custom_op("chunked_logits::shard_reduce", mutates_args=())
def _shard_reduce(key: str, x: torch.Tensor, operands: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(user_bodies.body(key)(x, *operands))


@_shard_reduce.register_fake
def _(key, x, operands):
    return list(user_bodies.fake_function(key)(x, *operands))


@torch.library.custom_op("chunked_logits::shard_reduce_backward", mutates_args=())
def _shard_reduce_backward(key: str, wanted: list[int], x: torch.Tensor, operands: list[torch.Tensor],
                           grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(user_bodies.backward_body(key, tuple(wanted))(x, *operands, *grads))


@_shard_reduce_backward.register_fake
def _(key, wanted, x, operands, grads):
    inputs = (x, *operands)
    return [torch.empty_like(inputs[i]) for i in wanted]


def _setup(ctx, inputs, output):
    args = save_inputs(ctx, _shard_reduce, inputs)
    keep_result_specs(ctx, output)
    ctx.wanted = [0] + [1 + i for i, o in enumerate(args["operands"]) if o.requires_grad]


def _backward(ctx, grads):
    args, _ = saved_inputs(ctx)
    got = call_by_name(_shard_reduce_backward, args, wanted=ctx.wanted,
                       grads=grads_or_zeros(ctx, grads, args["x"].device))
    result: list[Optional[torch.Tensor]] = [None] * (1 + len(args["operands"]))
    for i, g in zip(ctx.wanted, got):
        result[i] = g
    return grads_by_name(_shard_reduce, ctx.lengths, x=result[0], operands=result[1:])


_shard_reduce.register_autograd(_backward, setup_context=_setup)


@emitted(("shard_reduce", "shard_reduce_backward"), CAPTURE_SAFE)
def shard_reduce(key: str, differentiable: bool, x: torch.Tensor, *operands: torch.Tensor):
    """The reductions of one stage of a rewritten vocab-parallel region (see the module doc)."""
    if not differentiable:
        x, operands = x.detach(), tuple(o.detach() for o in operands)
    return tuple(_shard_reduce(key, x, list(operands)))
