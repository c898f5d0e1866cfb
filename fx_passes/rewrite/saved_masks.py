"""A row-local region's backward without its sorts: the forward saves the boolean masks
that its non-differentiable ops make, packed eight to a byte, and the backward reads them.

In a top-k / top-p / min-p region the gradient flows through ``masked_fill`` /
``where`` only; the ops that decide *which* entries are kept (``topk``'s threshold, the
``sort`` / ``cumsum`` / ``scatter`` of top-p) end in boolean ``[rows, .., V]`` masks
that no gradient goes through.  Recomputing them in the
backward repeats the forward's most expensive work (a sort of every row).  Here:

* a *saved mask* is a boolean node of the body shaped like one of its row inputs, read by
  a node that is not boolean (the boundary of the mask-making ops), and made with at
  least one sort, top-k or scan (:data:`REORDERING`): a mask made by pointwise ops and
  reductions alone (min-p's) is cheaper to recompute than to save;
* the *saving* body is the region's body that also returns each saved mask packed
  (:func:`fx_passes.kernels.bitmask.pack_bits`: ``V / 8`` bytes a row);
* the *replaying* body takes the packed masks as extra per-row inputs and reads them in
  place of the nodes that made them, which dead-code elimination then drops: its
  vector-Jacobian product is the cheap half of the maths, as stock autograd's backward is.

The masks the backward reads are the forward's own, so the gradient is that of the
values the forward returned (a recomputed sort could break ties otherwise; it does not
today, but saving removes the question).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from ..fx.graph_ops import meta
from ..kernels.bitmask import pack_bits, unpack_bits
from ..match.row_local import op_name, same

__all__ = ["SavedMasks", "saved_masks", "REORDERING"]

# What makes a mask worth saving: ops that sort or scan a row, which cost several passes
# over it (a reduction or a softmax that Inductor fuses into one pass is cheaper to run
# again than a saved mask is to write and read back: min-p's mask is not saved)
REORDERING = frozenset({"sort", "argsort", "msort", "topk", "kthvalue", "cumsum", "cumprod", "logcumsumexp",
                        "cummax", "cummin"})


@dataclasses.dataclass(frozen=True)
class SavedMasks:
    """The two bodies of a region whose forward saves masks for its backward."""

    saving: GraphModule  # (*rows, *whole) -> (*outputs, *packed masks)
    replaying: GraphModule  # (*rows, *whole, *packed masks) -> outputs
    count: int  # masks saved


def _row_input(v: torch.Tensor, row_shapes: list[tuple[Any, ...]]) -> int | None:
    for j, shape in enumerate(row_shapes):
        if len(shape) == v.dim() and all(same(a, b) for a, b in zip(v.shape, shape)):
            return j
    return None


def _is_bool(node: Any) -> bool:
    v = meta(node) if isinstance(node, Node) else None
    return isinstance(v, torch.Tensor) and v.dtype == torch.bool


def _made_along_rows(node: Node, seen: set[Node]) -> bool:
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        if op_name(n) in REORDERING:
            return True
        stack.extend(n.all_input_nodes)
    return False


def _cuts(body: GraphModule, row_shapes: list[tuple[Any, ...]]) -> list[tuple[Node, int]]:
    """The masks to save, each with the row input whose shape it has."""
    cuts = []
    for n in body.graph.nodes:
        if n.op not in ("call_function", "call_method") or not _is_bool(n) or meta(n).dim() < 2:
            continue
        j = _row_input(meta(n), row_shapes)
        if j is None or all(_is_bool(u) for u in n.users):
            continue
        if _made_along_rows(n, set()):
            cuts.append((n, j))
    return cuts


def _copy(body: GraphModule, replace: dict[Node, Any]) -> tuple[Graph, dict[Node, Node], Any]:
    """``body``'s graph copied node by node, ``replace(env)`` making a node's stand-in."""
    g, env = Graph(), {}
    outputs = None
    for n in body.graph.nodes:
        if n.op == "output":
            outputs = map_arg(n.args[0], lambda a: env[a])
        elif n in replace:
            env[n] = replace[n](g, env)
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    return g, env, outputs


def _masked_fill(n: Node) -> tuple[Node, Any, Any] | None:
    """(input, mask, value) of a ``masked_fill`` node."""
    if n.op == "call_method" and n.target == "masked_fill" or n.op == "call_function" and n.target in (
            torch.masked_fill, torch.Tensor.masked_fill):
        args = list(n.args) + [n.kwargs.get(k) for k in ("mask", "value")[len(n.args) - 1:]]
        return args[0], args[1], args[2]
    return None


def _groups(replaying: Graph, unpacked: dict[Node, int], like: list[int]) -> list[int]:
    """Each saved mask's group: masks read by a chain ``x.masked_fill(a, v).masked_fill(b, v)``
    (the inner result read by the outer alone, each mask by its fill alone) form one group,
    saved once as ``a | b`` (a top-k then top-p support: one mask, not two).  Filling by
    the union twice is the chain's value and gradient; the inner result, which differs,
    has no other reader.  (``like``: each mask's row input; masks of two shapes stay apart.)"""
    group = list(range(len(like)))

    def find(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i
    for n in replaying.nodes:
        outer = _masked_fill(n)
        inner = _masked_fill(outer[0]) if outer and isinstance(outer[0], Node) else None
        if not inner or inner[2] != outer[2] or len(outer[0].users) != 1:
            continue
        masks = [inner[1], outer[1]]
        if all(m in unpacked and len(m.users) == 1 for m in masks) and \
                like[unpacked[masks[0]]] == like[unpacked[masks[1]]]:
            group[find(unpacked[masks[1]])] = find(unpacked[masks[0]])
    return [find(i) for i in range(len(like))]


def _replaying(body: GraphModule, cuts: list[tuple[Node, int]], group: list[int]) -> tuple[Graph, dict]:
    """The body reading saved mask ``group[i]`` in place of cut ``i``; dead code dropped."""
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    saved = sorted(set(group))
    inputs: list[Node] = []
    unpacked: dict[Node, int] = {}

    def after_placeholders(g: Graph, env: dict) -> Node:
        node = g.node_copy(placeholders[-1], lambda a: env[a])
        inputs.extend(g.placeholder(f"mask{i}") for i in range(len(saved)))
        return node

    def reading(i: int, j: int):
        def make(g: Graph, env: dict) -> Node:
            node = g.call_function(unpack_bits, (inputs[saved.index(group[i])], env[placeholders[j]]))
            unpacked[node] = i
            return node
        return make
    stand_in: dict[Node, Any] = {placeholders[-1]: after_placeholders}
    stand_in.update({c: reading(i, j) for i, (c, j) in enumerate(cuts)})
    g, _, outputs = _copy(body, stand_in)
    g.output(outputs)
    g.eliminate_dead_code()
    return g, {n: i for n, i in unpacked.items() if n.graph is g and n.users}


def saved_masks(body: GraphModule, row_shapes: list[tuple[Any, ...]]) -> SavedMasks | None:
    """The saving and replaying bodies of ``body`` (a row-local region's
    ``fn(*rows, *whole)``, whose row inputs have ``row_shapes``), or None when it makes no
    mask worth saving."""
    cuts = _cuts(body, row_shapes)
    if not cuts:
        return None
    g, unpacked = _replaying(body, cuts, list(range(len(cuts))))
    group = _groups(g, unpacked, [j for _, j in cuts])
    replaying, _ = _replaying(body, cuts, group)

    g, env, outputs = _copy(body, {})
    packed = []
    for root in sorted(set(group)):
        members = [env[c] for (c, _), r in zip(cuts, group) if r == root]
        union = members[0]
        for m in members[1:]:
            union = g.call_function(torch.logical_or, (union, m))
        packed.append(g.call_function(pack_bits, (union,)))
    g.output((*outputs, *packed))
    saving = GraphModule(torch.nn.Module(), g)
    return SavedMasks(saving, GraphModule(torch.nn.Module(), replaying), len(packed))
