"""Which of a loss's operands are masks, and why a masked loss runs every row.

:func:`masks_among`: the operands of a matched tail that are masks (the only zeros the
skip graph counts, NOTE [rows a loss leaves out] in ``match/row_mask.py``);
:func:`mask_read`: a mask that what reads a region's results applies (for a near miss:
nothing is proved); :func:`why_every_row` / :func:`no_rule`: the reason said when a
masked loss runs every row (NOTE [why every row runs]).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Node

from ..fx.graph_ops import canon, is_collective, meta, op_name
from ..fx.op_rules import ZERO_ROWS, Kind
from .loss_tail import LossTail

__all__ = ["masks_among", "mask_read", "no_rule", "why_every_row"]


# NOTE [why every row runs]
# A loss with a mask whose skip graph is False whatever the inputs hold runs every row, as
# stock does; the user would expect the mask to count, so the rewrite says why not (the
# region's line in the log and the exit summary; counter ``masked_rows_not_skipped``):
# the first op with no rule (its facts unknown, so nothing proves a masked row's value and
# gradient are 0), else the first result read without the mask (an entropy bonus's
# ``ent.mean()``, a per-token value the graph returns for every row).  Nothing is said for
# a loss with no mask at all (most per-token results), nor with the option off.


def no_rule(n: Node, e: Exception) -> str:
    """``e`` (a :class:`_NoRule` at node ``n``) as said: the node named once."""
    said = str(e)
    return said if said.startswith(f"{n.name}:") else f"{n.name}: {said}"


def why_every_row(masks: bool, unknown: list[str], unmasked: list[str]) -> Optional[str]:
    """The reason a masked loss runs every row (NOTE [why every row runs]), None without a mask."""
    if not masks:
        return None
    if unknown:
        return f"{unknown[0]}, so nothing proves a masked row's value and gradient are exactly 0"
    if unmasked:
        return unmasked[0]
    return "nothing proves a masked row's gradient is exactly 0"


def _column(n: Node) -> bool:
    """``x[:, None]`` / ``x[..., None]``: a per-row value as a column (its rows in order)."""
    return op_name(n) == "getitem" and len(n.args) == 2 and n.args[1] in ((slice(None), None), (..., None))


def _sources(node: Node) -> set[Node]:
    """``node`` and what it converts or views (a column of it too), back to the first other op."""
    out = {node}
    while (canon(node) == "convert" or ZERO_ROWS.get(op_name(node)) in (Kind.SAME, Kind.ROW_VIEW)
           or _column(node)) and node.all_input_nodes:
        node = node.all_input_nodes[0]
        out.add(node)
    return out


def _mask_like(tail: LossTail) -> set[Node]:
    """The row operands that are masks (:func:`masks_among`)."""
    return set(masks_among(tail, tail.row_operands))


def masks_among(tail: LossTail, nodes: list) -> list:
    """Those of ``nodes`` (graph nodes, or None) that are masks: a boolean or integer
    tensor (or a conversion of one), or one the tail sums whole (a masked mean's ``/
    mask.sum()``, clamped or not).  A factor such as an advantage may be 0 on some rows
    too, but reading the count every step to find out is not worth its host sync (NOTE
    [rows a loss leaves out])."""
    summed, seen = set(), set()
    stack = [(w, 0) for w in tail.whole]  # (a sum a few ops up: ``mask.sum().clamp(min=1)``)
    while stack:
        w, depth = stack.pop()
        if w in seen or depth > 3:
            continue
        seen.add(w)
        if op_name(w) in ("sum", "mean") and w.all_input_nodes:
            summed |= _sources(w.all_input_nodes[0])
        stack += [(a, depth + 1) for a in w.all_input_nodes]
    out = []
    for o in nodes:
        src = _sources(o) if isinstance(o, Node) else set()
        kinds = {getattr(meta(n), "dtype", None) for n in src}
        if src & summed or any(isinstance(d, torch.dtype) and not d.is_floating_point for d in kinds):
            out.append(o)
    return out


_MASKING = {"mul", "where", "masked_fill", "masked_fill_"}


def mask_read(results: list[Node], region: frozenset = frozenset(), inputs: list = (),
              limit: int = 400) -> Optional[Node]:
    """A mask that what reads ``results`` (per-row values of a region whose call has no
    masked variant) applies to them, else None: an operand of a ``mul`` / ``where`` /
    ``masked_fill`` that is boolean or integer, or that they divide by the sum of (a
    masked mean).  An op whose result a collective reads is not one (a vocab-parallel
    ``where(own, picked, 0)`` selects the rank that owns a target), nor one of ``region``
    (the region's own nodes, read through); of the region's row ``inputs``, one that is
    boolean or summed so (a mask its body applies).  For a near miss only (NOTE [why every
    row runs]): nothing is proved."""
    seen: dict[Node, None] = {}
    stack = list(results)
    while stack and len(seen) < limit:
        for u in stack.pop().users:
            if u not in seen and u.op != "output":
                seen[u] = None
                stack.append(u)
    summed: set[Node] = set()
    for n in seen:
        if op_name(n) in ("div", "true_divide") and len(n.args) > 1 and isinstance(n.args[1], Node):
            d = n.args[1]
            while op_name(d) in ("clamp", "clamp_min", "clip") and d.all_input_nodes:
                d = d.all_input_nodes[0]
            if op_name(d) in ("sum", "mean") and d.all_input_nodes:
                summed |= _sources(d.all_input_nodes[0])
    shared: set[Node] = set()  # read by a collective, through the readers
    stack = [n for n in seen if is_collective(n)]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a in seen and a not in shared:
                shared.add(a)
                stack.append(a)
    inner = set(results) | set(seen)
    for n in seen:
        if op_name(n) not in _MASKING or n in shared or n in region:
            continue
        for a in n.all_input_nodes:
            dtype = getattr(meta(a), "dtype", None)
            if a not in inner and (_sources(a) & summed or isinstance(dtype, torch.dtype)
                                   and not dtype.is_floating_point):
                return a
    for a in inputs:
        if isinstance(a, Node) and (_sources(a) & summed or getattr(meta(a), "dtype", None) is torch.bool):
            return a
    return None
