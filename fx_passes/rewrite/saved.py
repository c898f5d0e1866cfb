"""What a row-local region's forward saves for its backward, so that the backward does
not redo the forward's most expensive work: the boolean masks of its sorts, and the
normalisers of its softmaxes.

The *saving* body is the region's body that also returns what is saved (masks bit-packed,
``V / 8`` bytes a row; two numbers a row per softmax); the *replaying* body takes it as
extra per-row inputs in place of the nodes that made it.  See NOTE [saved state].
"""

# NOTE [saved state]
# The backward recomputes the region's values chunk by chunk to take their
# vector-Jacobian product.  Two kinds of node cost far more to recompute than to save:
#
# * **masks**.  In a top-k / top-p region the gradient flows through ``masked_fill`` /
#   ``where`` only; the ops that decide *which* entries are kept (``topk``'s threshold, the
#   ``sort`` / ``cumsum`` / ``scatter`` of top-p) end in boolean ``[rows, .., V]`` masks
#   that no gradient goes through.  A boolean node of the body shaped like one of its row
#   inputs, read by a node that is not boolean (the boundary of the mask-making ops), and
#   made with at least one sort, top-k or scan (:data:`REORDERING`) is saved, packed eight
#   to a byte (:func:`fx_passes.kernels.row_local.bitmask.pack_bits`: ``V / 8`` bytes a row).  A mask
#   made by pointwise ops and reductions alone (min-p's) is cheaper to recompute.
# * **normalisers**.  A ``softmax`` / ``log_softmax`` over a row is two reductions (a max,
#   a sum of exponentials) before its pointwise result; the saving body computes it as
#   ATen decomposes it and also returns the two reductions (one number a row each, from
#   the same fused loop), and the backward computes the values pointwise from them, bit
#   for bit the forward's, with the op's own gradient (:mod:`fx_passes.kernels.row_local.normalizers`).
#
# The *saving* body is the region's body that also returns what is saved; the
# *replaying* body takes it as extra per-row inputs and reads it in place of the nodes
# that made it, which dead-code elimination then drops: its vector-Jacobian product is
# the cheap half of the maths, as stock autograd's backward is.  What the backward reads
# is the forward's own (a recomputed sort could break ties otherwise; it does not today,
# but saving removes the question).

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from ..fx.graph_ops import meta, op_name, same_shape
from ..kernels.row_local.bitmask import pack_bits, unpack_bits
from ..kernels.row_local.normalizers import log_softmax_given, log_softmax_stats, softmax_given, softmax_stats

__all__ = ["Saved", "saved_for_backward", "REORDERING"]

# What makes a mask worth saving: ops that sort or scan a row, which cost several passes
# over it (a reduction or a softmax that Inductor fuses into one pass is cheaper to run
# again than a saved mask is to write and read back: min-p's mask is not saved)
REORDERING = frozenset({"sort", "argsort", "msort", "topk", "kthvalue", "cumsum", "cumprod", "logcumsumexp",
                        "cummax", "cummin"})


@dataclasses.dataclass(frozen=True)
class Saved:
    """The two bodies of a region whose forward saves state for its backward."""

    saving: GraphModule  # (*rows, *whole) -> (*outputs, *packed masks, *normalisers)
    replaying: GraphModule  # (*rows, *whole, *packed masks, *normalisers) -> outputs
    masks: int  # masks saved
    normalizers: int  # softmaxes whose two row statistics are saved

    @property
    def count(self) -> int:
        """Tensors saved (the saving body's outputs past the region's own)."""
        return self.masks + 2 * self.normalizers


def _row_input(v: torch.Tensor, row_shapes: list[tuple[Any, ...]]) -> int | None:
    for j, shape in enumerate(row_shapes):
        if same_shape(v.shape, shape):
            return j
    return None


def _is_bool(node: Any) -> bool:
    v = meta(node) if isinstance(node, Node) else None
    return isinstance(v, torch.Tensor) and v.dtype == torch.bool


def _made_by_reordering(node: Node, seen: set[Node]) -> bool:
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
        if _made_by_reordering(n, set()):
            cuts.append((n, j))
    return cuts


_STATS = {"log_softmax": log_softmax_stats, "softmax": softmax_stats}
_GIVEN = {"log_softmax": log_softmax_given, "softmax": softmax_given}


def _value(node: Any) -> Any:
    """The example value of a body node (a ``detach`` the body added has its input's)."""
    while isinstance(node, Node) and "example_value" not in node.meta and "val" not in node.meta \
            and node.op == "call_method" and node.target == "detach":
        node = node.args[0]
    return meta(node) if isinstance(node, Node) else None


def _normalized(n: Node) -> tuple[Node, int] | None:
    """(input, dim) of a ``softmax`` / ``log_softmax`` over one dim of a floating
    per-row tensor, other than dim 0, without a ``dtype``."""
    if op_name(n) not in _GIVEN or n.op not in ("call_function", "call_method"):
        return None
    z, args = n.args[0] if n.args else n.kwargs.get("input"), list(n.args[1:])
    dim = n.kwargs.get("dim", args[0] if args else None)
    v = _value(z)
    if not isinstance(dim, int) or not isinstance(v, torch.Tensor) or not v.is_floating_point() \
            or v.dim() < 2:
        return None
    if n.kwargs.get("dtype") is not None or any(not isinstance(a, int) for a in args[1:] if a is not None):
        return None  # (a dtype; F.softmax's int _stacklevel is no dtype)
    return (z, dim) if dim % v.dim() != 0 else None


def _norms(body: GraphModule) -> list[tuple[Node, Node, int]]:
    """(node, its input, dim) of each softmax / log_softmax whose normaliser to save."""
    return [(n, *found) for n in body.graph.nodes if (found := _normalized(n)) is not None]


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


def _replaying(body: GraphModule, cuts: list[tuple[Node, int]], group: list[int],
               norms: list[tuple[Node, Node, int]]) -> tuple[Graph, dict, dict]:
    """The body reading saved mask ``group[i]`` in place of cut ``i`` and each
    softmax's values from its saved normaliser; dead code dropped."""
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    saved = sorted(set(group))
    inputs: list[Node] = []
    lses: list[Node] = []
    unpacked: dict[Node, int] = {}

    def after_placeholders(g: Graph, env: dict) -> Node:
        node = g.node_copy(placeholders[-1], lambda a: env[a])
        inputs.extend(g.placeholder(f"mask{i}") for i in range(len(saved)))
        lses.extend(g.placeholder(f"{kind}{i}") for i in range(len(norms)) for kind in ("max", "norm"))
        return node

    def reading(i: int, j: int):
        def make(g: Graph, env: dict) -> Node:
            node = g.call_function(unpack_bits, (inputs[saved.index(group[i])], env[placeholders[j]]))
            unpacked[node] = i
            return node
        return make
    def pointwise(i: int, n: Node, z: Node, dim: int):
        return lambda g, env: g.call_function(_GIVEN[op_name(n)], (env[z], *lses[2 * i:2 * i + 2], dim))
    stand_in: dict[Node, Any] = {placeholders[-1]: after_placeholders}
    stand_in.update({c: reading(i, j) for i, (c, j) in enumerate(cuts)})
    stand_in.update({n: pointwise(i, n, z, dim) for i, (n, z, dim) in enumerate(norms)})
    g, env, outputs = _copy(body, stand_in)
    g.output(outputs)
    g.eliminate_dead_code()
    live = set(g.nodes)
    kept = {k: v for k, v in env.items() if v in live}
    return g, {n: i for n, i in unpacked.items() if n in live and n.users}, kept


def saved_for_backward(body: GraphModule, row_shapes: list[tuple[Any, ...]], masks: bool = True,
                       normalizers: bool = True) -> Saved | None:
    """The saving and replaying bodies of ``body`` (a row-local region's
    ``fn(*rows, *whole)``, whose row inputs have ``row_shapes``), or None when there is
    nothing worth saving (``masks`` / ``normalizers``: which kinds to look for)."""
    cuts = _cuts(body, row_shapes) if masks else []
    norms = _norms(body) if normalizers else []
    if not cuts and not norms:
        return None
    g, unpacked, _ = _replaying(body, cuts, list(range(len(cuts))), [])
    group = _groups(g, unpacked, [j for _, j in cuts])
    _, _, live = _replaying(body, cuts, group, [])
    norms = [(n, z, dim) for n, z, dim in norms if n in live]  # (top-p's softmax feeds only its sort)
    if not cuts and not norms:
        return None
    replaying, _, _ = _replaying(body, cuts, group, norms)

    stats: list[Node] = []

    def decomposed(n: Node, z: Node, dim: int):  # the op as ATen decomposes it, its reductions kept
        def make(g: Graph, env: dict) -> Node:
            both = g.call_function(_STATS[op_name(n)], (env[z], dim))
            stats.extend(g.call_function(operator.getitem, (both, k)) for k in (1, 2))
            return g.call_function(operator.getitem, (both, 0))
        return make
    g, env, outputs = _copy(body, {n: decomposed(n, z, dim) for n, z, dim in norms})
    packed = []
    for root in sorted(set(group)):
        members = [env[c] for (c, _), r in zip(cuts, group) if r == root]
        union = members[0]
        for m in members[1:]:
            union = g.call_function(torch.logical_or, (union, m))
        packed.append(g.call_function(pack_bits, (union,)))
    g.output((*outputs, *packed, *stats))
    saving = GraphModule(torch.nn.Module(), g)
    return Saved(saving, GraphModule(torch.nn.Module(), replaying), len(packed), len(norms))
