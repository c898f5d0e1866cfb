"""A slice of the rows of an FP32 upcast, moved before the upcast (and before the lm_head
matmul that makes the logits) for a row-local region (NOTE [slice first])::

    z = F.linear(h, w).float()[:-1]        # becomes    z = F.linear(h[:-1], w).float()

so that the region starts at an upcast whose rows are its own rows, and the call can run
the lm_head chunk by chunk.  The move is undone when the region is not rewritten.
"""

# NOTE [slice first]
# The row-local path (``match/row_local.py``) takes the rows of a region to be dim 0 of its
# upcast; ``logits.float()[:-1]`` (a shift written after the upcast, in ``[T, V]``) indexes
# them and is not row-local.  An upcast is elementwise and exact, so a view of its rows
# commutes with it: ``x.float()[i] == x[i].float()`` element for element, and so does the
# gradient (zeros for the rows the slice leaves out, either way).  An lm_head matmul acts on
# each row of its hidden states on its own: ``linear(h, w, b)[i]`` is ``linear(h[i], w, b)``,
# each row the same dot products (a GEMM of fewer rows, which may block its sums
# differently: no more error than stock's, as every GEMM the pass makes, and
# ``tests/test_row_local_slices.py`` checks it against FP64).  The sliced hidden states are
# made contiguous: ATen's ``linear`` of a strided ``[B, S, H]`` input (``h[:, :-1]``) runs
# ``matmul`` then adds the bias, rounding the dot products to bf16 before the bias is added
# (5 bf16 spacings off at a logit of 0.07 where the bias was 1.5, seen), where stock's
# ``linear`` of the whole contiguous ``h`` runs one ``addmm`` that rounds once.
#
# The move is made when the one reader of the upcast is a row view that does not keep dim
# 0 whole (``is_row_view``: basic indexing that keeps each row's V entries whole, here a
# getitem of static slices and ints), or when the upcast reads such a view (any, dim 0
# whole or not) of an lm_head matmul's logits; through the matmul only when nothing else
# reads its logits (as the lm_head fusion requires).  It adds the new nodes beside the old
# and points the readers at them.  A region that reads another upcast's row slice as an
# FP32 row input (a teacher's ``teacher.float()[:-1]`` in a distillation loss) gets that
# slice moved the same way (``sliced_upcasts``), and the region is found again.  ``undo``
# points the readers back and erases the new nodes (the graph as it was, the decline naming
# the user's nodes), ``finish`` erases the old ones once the region is rewritten.

from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any, Optional

from torch.fx import Graph, Node

from ..fx.graph_ops import get_arg, tensor_input
from ..match.lm_head import producer
from ..match.upcast import is_row_view, upcast_input
from ..reporting.report import Decline
from .row_slices import example_value

__all__ = ["SliceFirst", "slice_first", "Moves", "sliced_upcasts"]


@dataclasses.dataclass
class SliceFirst:
    """A move made: ``seed`` is the upcast the region now starts at."""

    graph: Graph
    seed: Node
    new: list[Node]  # in graph order
    old: list[Node]  # the nodes the move leaves without readers: the views, the upcast (the matmul)
    readers: list[tuple[Node, Node]]  # (reader, the view it read)

    def undo(self, decline: Decline) -> Decline:
        """Put the graph back as it was; ``decline`` (raised after the move) naming the
        user's nodes instead of the move's (the new upcast is the view it replaced)."""
        for reader, view in self.readers:
            reader.replace_input_with(self.seed, view)
        names = {self.seed.name: self.old[0].name}
        for n in reversed(self.new):
            self.graph.erase_node(n)
        detail = re.sub(r"\b\w+\b", lambda m: names.get(m.group(0), m.group(0)), decline.detail)
        return Decline(decline.reason, detail)

    def finish(self) -> None:
        for n in self.old:
            if not n.users:
                self.graph.erase_node(n)


class Moves:
    """The moves made for one region (its own upcast's, a teacher's): undone, or finished,
    together."""

    def __init__(self) -> None:
        self.made: list[SliceFirst] = []

    def add(self, move: Optional[SliceFirst]) -> Optional[SliceFirst]:
        if move is not None:
            self.made.append(move)
        return move

    @property
    def old(self) -> list[Node]:
        return [n for m in self.made for n in m.old]

    def undo(self, decline: Decline) -> Decline:
        for m in reversed(self.made):
            decline = m.undo(decline)
        self.made = []
        return decline

    def finish(self) -> None:
        for m in self.made:
            m.finish()


def sliced_upcasts(rows: list[Any]) -> list[Node]:
    """The upcasts whose row slice a region reads as an FP32 row input (a teacher's
    ``teacher.float()[:-1]``, read by nothing else): :func:`slice_first` moves them too."""
    ups = []
    for r in rows:
        up = tensor_input(r) if isinstance(r, Node) else None
        if isinstance(up, Node) and upcast_input(up) is not None and _row_view(r, up, rows=True) is not None:
            ups.append(up)
    return ups


def _index(view: Node, rows: bool) -> Optional[Any]:
    """The index of ``view``, a getitem of static slices / ints / None / Ellipsis; with
    ``rows``, only one that does not keep dim 0 of its input whole."""
    if view.op != "call_function" or view.target is not operator.getitem:
        return None
    index = get_arg(view, "index")
    items = index if isinstance(index, tuple) else (index,)
    if not all(i is None or i is Ellipsis or isinstance(i, int) or (
            isinstance(i, slice) and all(b is None or isinstance(b, int) for b in (i.start, i.stop, i.step)))
               for i in items):
        return None
    if rows and (not items or items[0] == slice(None) or items[0] is Ellipsis or items[0] is None):
        return None  # (dim 0 whole, or moved: the region's rows already)
    return index


def _row_view(view: Node, src: Node, rows: bool) -> Optional[Any]:
    """The index of ``view`` when it is a row view of ``src`` that only ``view`` reads."""
    if not isinstance(src, Node) or tensor_input(view) is not src or len(src.users) != 1 \
            or not is_row_view(view, src):
        return None
    return _index(view, rows)


def slice_first(graph: Graph, up: Node) -> Optional[SliceFirst]:
    """Move before the upcast ``up`` the slice of the rows that is its one reader, and
    before the lm_head matmul (``up``'s input, read by nothing else) that or the row view
    of the matmul's logits ``up`` reads; or None (nothing changed)."""
    x = upcast_input(up)
    if x is None:
        return None
    view = next(iter(up.users)) if len(up.users) == 1 else None
    index = _row_view(view, up, rows=True) if view is not None else None
    if index is not None:  # (logits.float()[:-1])
        logits, old, readers = x, [view, up], list(view.users)
    elif (index := _row_view(x, tensor_input(x), rows=False)) is not None and len(x.users) == 1 \
            and producer(tensor_input(x)) is not None:  # (F.linear(h, w)[:, :-1].float())
        logits, old, readers = tensor_input(x), [up, x], list(up.users)
    else:
        return None
    head = producer(logits) if len(logits.users) == 1 else None
    through = head is not None and isinstance(head.hidden, Node)
    if logits is not x and not through:
        return None  # (a view before the upcast and no matmul to move it through: nothing to do)
    new: list[Node] = []
    with graph.inserting_after(up):
        if through:
            h = head.hidden
            hidden = _node(graph, new, "call_function", operator.getitem, (h, index), {}, h)
            # (contiguous: ``linear`` of a strided 3-D input adds its bias after rounding the
            # matmul's output, a second rounding stock's ``addmm`` does not make)
            hidden = _node(graph, new, "call_method", "contiguous", (hidden,), {}, h)
            args = tuple(hidden if a is h else a for a in logits.args)
            kwargs = {k: hidden if v is h else v for k, v in logits.kwargs.items()}
            rows = _node(graph, new, logits.op, logits.target, args, kwargs, logits)
            old.append(logits)
        else:
            rows = _node(graph, new, "call_function", operator.getitem, (x, index), {}, x)
        args = tuple(rows if a is x else a for a in up.args)
        kwargs = {k: rows if v is x else v for k, v in up.kwargs.items()}
        seed = _node(graph, new, up.op, up.target, args, kwargs, up)
    before = old[0]  # (what the readers read: the view after the upcast, or the upcast)
    for reader in readers:
        reader.replace_input_with(before, seed)
    return SliceFirst(graph, seed, new, old, [(r, before) for r in readers])


def _node(graph: Graph, new: list[Node], op: str, target: Any, args: tuple, kwargs: dict, like: Node) -> Node:
    """A node after the last of ``new``, its example value computed, its source ``like``'s."""
    value = example_value(op, target, args, kwargs)
    if new:
        with graph.inserting_after(new[-1]):
            n = graph.create_node(op, target, args, kwargs)
    else:
        n = graph.create_node(op, target, args, kwargs)
    n.meta.update({k: v for k, v in like.meta.items() if k in ("stack_trace", "nn_module_stack")})
    n.meta["example_value" if "example_value" in like.meta else "val"] = value
    new.append(n)
    return n
