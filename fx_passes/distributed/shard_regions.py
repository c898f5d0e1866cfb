"""Finding vocab-parallel regions: the FP32 ``[.., V / world]`` part of a loss written on
this rank's vocabulary shard (the upcast, elementwise ops with per-row or scalar operands,
the reductions over the last dim that end it), whose per-row results reach a functional
collective; its *stages* (the reductions whose per-row operands are ready at the same
time); and the placement checks of the region (:mod:`fx_passes.fx.placement`).
:mod:`fx_passes.distributed.shard_stages` rewrites what this module finds."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.fx import Graph, Node

from ..fx.graph_ops import (
    canon,
    get_arg,
    is_collective,
    is_elementwise,
    is_fp32,
    is_scalar,
    last_dim,
    meta,
    requires_grad,
    tensor_input,
)
from ..fx.placement import mutation_of, same_state, view_family, writes_in_place
from ..match.upcast import upcast_input
from ..reporting.report import Decline, Reason

__all__ = ["ShardRegion", "find_shard_regions"]


# Reductions over the last dim that end a region.
_REDUCTIONS = {"sum", "amax", "logsumexp", "gather", "mean"}


def reduction_kind(node: Node) -> Optional[str]:
    """The reduction ``node`` is ('sum', 'amax', ...) if it reduces its input's last dim."""
    op = canon(node)
    if op is None:
        if node.op == "call_method" and node.target in ("amax", "mean"):
            op = node.target
        elif node.op == "call_function" and node.target in (torch.amax, torch.mean):
            op = node.target.__name__
    if op not in _REDUCTIONS:
        return None
    src = tensor_input(node)
    if not isinstance(src, Node) or not isinstance(meta(src), torch.Tensor):
        return None
    if op == "gather":
        dim = get_arg(node, "dim")
    else:
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        if op in ("sum", "mean") and (node.kwargs.get("dtype") is not None or len(node.args) > 3):
            return None
    return op if last_dim(dim, meta(src).dim()) else None


def _reaches_collective(nodes: list[Node], rows: Any, depth: int = 6) -> bool:
    """Does a per-row result (``rows`` values) of ``nodes`` reach a functional collective
    while it is still per-row?  A vocabulary shard's statistics do; a loss all-reduced
    for logging (one value) does not make its region vocab-parallel."""
    frontier, seen = list(nodes), set(nodes)
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                if is_collective(u):
                    return True
                v = meta(u)
                if u not in seen and isinstance(v, torch.Tensor) and v.numel() == rows:
                    seen.add(u)
                    nxt.append(u)
        frontier = nxt
    return False


class ShardRegion:
    """The FP32 ``[.., V]`` nodes grown from one upcast, and the reductions that end them."""

    def __init__(self, upcast: Node, x: Node) -> None:
        self.upcast, self.x = upcast, x
        self.nodes: list[Node] = []  # elementwise FP32 [.., V] nodes, the upcast first
        self.reductions: list[Node] = []
        self.stages: list[list[Node]] = []

    def describe(self) -> str:
        kinds = "+".join(sorted({reduction_kind(r) for r in self.reductions}))
        return (f"vocab-parallel shard reductions ({kinds}) over {tuple(meta(self.upcast).shape)} "
                f"in {len(self.stages)} stage(s)")


def _grow(upcast: Node, x: Node) -> ShardRegion:
    """The region from ``upcast``; Decline if an FP32 ``[.., V]`` node has a reader that is
    neither an elementwise op nor a last-dim reduction."""
    region = ShardRegion(upcast, x)
    shape = tuple(meta(upcast).shape)
    inside, stack = {upcast}, [upcast]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in inside or u in region.reductions:
                continue
            if reduction_kind(u) and tensor_input(u) is n:
                region.reductions.append(u)
            elif is_elementwise(u) and is_fp32(u) and tuple(meta(u).shape) == shape:
                inside.add(u)
                stack.append(u)
            else:
                raise Decline(Reason.UNKNOWN_OP, f"{u.name} ({u.target}) reads the FP32 shard {n.name}")
    order = {n: i for i, n in enumerate(upcast.graph.nodes)}
    region.nodes = sorted(inside, key=order.__getitem__)
    region.reductions.sort(key=order.__getitem__)
    return region


def operands_of(region: ShardRegion, nodes: list[Node]) -> list[Node]:
    """The graph values ``nodes`` read that are not the region's: per-row or scalar
    tensors, and symbolic scalars (passed to the stage as 0-d tensors)."""
    inside = set(region.nodes)
    out: list[Node] = []
    rows = tuple(meta(region.upcast).shape[:-1])
    for n in nodes:
        for a in n.all_input_nodes:
            if a in inside or a in out or a is region.x:
                continue
            v = meta(a)
            if is_scalar(a):
                out.append(a)
                continue
            if not isinstance(v, torch.Tensor):
                raise Decline(Reason.UNKNOWN_OP, f"{n.name} reads {a.name}, not a tensor")
            per_row = v.dim() == 0 or (v.shape[-1] == 1 and v.numel() <= max(1, numel(rows)))
            if not per_row:
                raise Decline(Reason.UNKNOWN_OP, f"{n.name} reads {a.name} of shape {tuple(v.shape)}: "
                              "not one value per row")
            out.append(a)
    return out


def numel(shape: tuple) -> Any:
    out = 1
    for d in shape:
        out = out * d
    return out


def ancestors(node: Node, stop: set[Node]) -> set[Node]:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a not in seen and a not in stop:
                seen.add(a)
                stack.append(a)
    return seen


def cone(region: ShardRegion, reduction: Node) -> list[Node]:
    """The region's nodes ``reduction`` is computed from, the reduction last."""
    inside = set(region.nodes)
    need, stack = {reduction}, [reduction]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a in inside and a not in need:
                need.add(a)
                stack.append(a)
    return [n for n in region.nodes if n in need] + [reduction]


def _stages(region: ShardRegion) -> list[list[Node]]:
    """Group the reductions: stage k holds those whose operands depend on stage < k only."""
    stage: dict[Node, int] = {}
    for r in region.reductions:  # graph order: a reduction's dependencies come first
        ops = operands_of(region, cone(region, r))
        before = set()
        for o in ops:
            before |= ancestors(o, set()) | {o}
        deps = [stage[q] for q in region.reductions if q in before and q in stage]
        if any(q in before for q in region.reductions if q not in stage):
            raise Decline(Reason.ORDER, f"{r.name} reads a value computed from a later reduction")
        stage[r] = 1 + max(deps, default=-1)
    out: list[list[Node]] = [[] for _ in range(1 + max(stage.values(), default=-1))]
    for r in region.reductions:
        out[stage[r]].append(r)
    return out


def needs_grad(reduction: Node) -> bool:
    """Does ``reduction`` carry a gradient: it requires grad and something reads it other
    than ``.detach()`` (``z.amax(-1).detach()``, a shift, carries none)?"""
    def detach(u: Node) -> bool:
        return (u.op == "call_method" and u.target == "detach") or (
            u.op == "call_function" and u.target is torch.detach)
    return requires_grad(reduction) and not all(detach(u) for u in reduction.users)


def _gradients_in_one_stage(region: ShardRegion, stages: list[list[Node]]) -> list[list[Node]]:
    """A reduction that needs a gradient and reads no earlier stage's result lands in
    stage 0 (``z.gather(...)`` of the unshifted logits beside the max): moved to the last
    stage that needs a gradient, when no reduction up to that stage reads it, so that
    the logits gradient comes from one stage (one rounding) as written in one op."""
    grads = [i for i, s in enumerate(stages) if any(needs_grad(r) for r in s)]
    if len(grads) < 2:
        return stages
    last = grads[-1]
    read: set[Node] = set()
    for r in (q for s in stages[:last + 1] for q in s):
        for o in operands_of(region, cone(region, r)):
            read |= ancestors(o, set()) | {o}
    moved = {r for i in grads[:-1] for r in stages[i] if needs_grad(r) and r not in read}
    if not moved:
        return stages
    out = [[r for r in s if r not in moved] for s in stages]
    out[last] = [r for r in region.reductions if r in moved or r in out[last]]  # (graph order)
    return [s for s in out if s]


# --- the call a rewritten graph makes ------------------------------------------------

def find_shard_regions(graph: Graph) -> list[ShardRegion | tuple[Node, Decline]]:
    """Regions whose reductions feed a functional collective (vocab-parallel code)."""
    out: list[ShardRegion | tuple[Node, Decline]] = []
    for node in list(graph.nodes):
        x = upcast_input(node)
        if x is None:
            continue
        try:
            region = _grow(node, x)
        except Decline:
            continue  # not the shape of a shard region: the single-process matcher's to judge
        rows = numel(tuple(meta(node).shape[:-1]))
        if not region.reductions or not _reaches_collective(region.reductions, rows):
            continue
        try:
            region.stages = _gradients_in_one_stage(region, _stages(region))
            grads = [i for i, s in enumerate(region.stages) if any(needs_grad(r) for r in s)]
            if len(grads) > 1:
                raise Decline(Reason.UNKNOWN_OP, f"reductions in {len(grads)} dependent stages need a "
                              "gradient (the logits gradient would be rounded once per stage); detach "
                              "what is only a shift (the max) or compute the later sums from the earlier")
            for s in region.stages:
                if {needs_grad(r) for r in s} == {True, False}:
                    raise Decline(Reason.UNKNOWN_OP, "a stage mixes reductions with and without grad")
            _check_order(region)
        except Decline as d:
            out.append((node, d))
            continue
        out.append(region)
    return out


def _check_order(region: ShardRegion) -> None:
    """The rewrite reads the logits and each stage's per-row operands where the stage's
    first reduction was (:mod:`fx_passes.fx.placement`'s rule).  The region's nodes run
    under one grad mode and the same autocast / inference_mode blocks; between the
    upcast and the last reduction nothing may mutate the logits, and an in-place op must
    not fall between a region node that reads a per-row operand and its stage's first
    reduction (it could change that operand).  In-place ops elsewhere are fine:
    ``dist.all_reduce(m)`` on a reduction's result (Dynamo's ``m.copy_(wait_tensor(...))``)
    before the next stage."""
    graph = region.upcast.graph
    same_state(graph, [region.upcast, *region.nodes, *region.reductions])
    order = {n: i for i, n in enumerate(graph.nodes)}
    spans = []  # (first operand read, stage anchor) per stage
    inside = set(region.nodes)
    for stage in region.stages:
        reads = [n for r in stage for n in cone(region, r)
                 if any(a not in inside and a is not region.x for a in n.all_input_nodes)]
        if reads:
            spans.append((min(order[n] for n in reads), order[stage[0]]))
    last = region.reductions[-1]
    changed = mutation_of(graph, [region.x], last) if requires_grad(region.x) else None
    if changed is not None:  # the stage ops save the logits for their backward; the upcast did not
        raise Decline(Reason.MUTATION, f"{changed.name} changes the logits in place after the region")
    for n in graph.nodes:
        if order[n] <= order[region.upcast] or not writes_in_place(n):
            if n is last:
                return
            continue
        target = n.args[0] if n.args else None
        in_place = (n.op == "call_method" and isinstance(target, Node) and target not in inside
                    and target not in view_family(region.x))
        if not in_place or any(lo < order[n] < hi for lo, hi in spans):
            raise Decline(Reason.MUTATION, f"{n.name} ({n.target}) runs inside the region")
        if n is last:
            return


