"""Loops over the rows, merged: the same row-local ops run on each slice of the rows and
the results put back together in order become those ops on the whole tensor, so that the
matchers see one region (NOTE [row slices]).  RL frameworks write log-probs so::

    torch.stack([torch.logsumexp(l, dim=-1) for l in logits])          # x[i]: one row each
    torch.cat([x[s:s + c].logsumexp(-1) for s in range(0, n, c)])     # row slices
    torch.cat([c.logsumexp(-1) for c in x.split(c)])                  # split / chunk / unbind
"""

# NOTE [row slices]
# A *piece* is a group of whole rows of a tensor ``X``: ``X[i]`` (a select: the row dim is
# dropped), ``X[a:b]`` and the items of ``X.split`` / ``chunk`` / ``tensor_split`` /
# ``unbind`` along dim 0, with static bounds.  A ``stack`` (of selects) or ``cat`` (of
# slices) along dim 0 over items ``r_0 .. r_k-1`` is merged when
#
# * each ``r_j`` is computed from pieces of one cell of rows ``[a_j, b_j)`` (every piece in
#   it, of any source, covers those rows) and the cells, in the order of the items, cover
#   the rows exactly once (none missed, none twice, none out of order);
# * the subgraphs computing the items are the same ops on the same arguments (a piece of
#   source ``X`` in one where a piece of ``X`` is in the other; the same node where they
#   read a value computed from no piece), and none of their nodes is read elsewhere;
# * every op acts on each row on its own: pointwise maths with the row-dim operands of the
#   result's rank and the others broadcast (of lower rank, or of one row for a slice),
#   reductions / softmaxes / scans / gathers along dims named explicitly other than the
#   row dim (a select's dims move one to the right), basic indexing that keeps the rows.
#
# Then ``stack_j f(X[j]) = f(X)`` and ``cat_j f(X[a_j:b_j]) = f(X)`` row by row, the same
# sums in the same order per row.  The merged result's example value is computed (fake
# tensors) and must equal the stack's / cat's, or nothing is changed.

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Optional

import torch
from torch.fx import Graph, Node

from ..fx.graph_ops import canon, meta, mutates, op_name, same_shape
from ..fx.op_rules import pointwise_op

__all__ = ["merge_row_slices", "example_value"]

log = logging.getLogger(__name__)

_SPLITS = {"split", "chunk", "tensor_split", "unbind", "split_with_sizes"}
_PLAIN = {"float", "double", "half", "bfloat16", "to", "type_as", "detach", "clone", "contiguous"}
# op -> position of its dim argument (the tensor at 0); the dim must be given
_ALONG = {**dict.fromkeys(("sum", "mean", "amax", "amin", "logsumexp", "softmax", "log_softmax", "cumsum",
                           "logcumsumexp", "max", "min", "argmax", "argmin", "gather", "scatter",
                           "scatter_add", "squeeze", "unsqueeze"), 1)}
_INDEXED = {"gather": 2, "scatter": 2, "scatter_add": 2}  # op -> position of its per-row index


@dataclasses.dataclass(frozen=True)
class _Piece:
    source: Node
    start: int
    stop: int
    select: bool  # X[i] (the row dim dropped), else a slice of rows


def _rows(x: Any) -> Optional[int]:
    v = meta(x) if isinstance(x, Node) else None
    return v.shape[0] if isinstance(v, torch.Tensor) and v.dim() and isinstance(v.shape[0], int) else None


def _piece(node: Node) -> Optional[_Piece]:
    """``node`` as a group of whole rows of a tensor with a static row count, else None."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    src, index = node.args
    if isinstance(meta(src), (tuple, list)) and isinstance(src, Node) and op_name(src) in _SPLITS:
        return _split_piece(src, index)
    n = _rows(src)
    index = index[0] if isinstance(index, tuple) and len(index) == 1 else index
    if n is None or isinstance(index, bool):
        return None
    if isinstance(index, int) and -n <= index < n:
        return _Piece(src, index % n, index % n + 1, True)
    if isinstance(index, slice) and index.step in (None, 1) and all(
            isinstance(b, (int, type(None))) for b in (index.start, index.stop)):
        start, stop, _ = index.indices(n)
        return _Piece(src, start, max(start, stop), False) if stop > start else None
    return None


def _split_piece(split: Node, j: Any) -> Optional[_Piece]:
    x, parts = split.args[0], meta(split)
    at = 1 if op_name(split) == "unbind" else 2
    dim = split.kwargs.get("dim", split.args[at] if len(split.args) > at else 0)
    n = _rows(x)
    if n is None or not isinstance(j, int) or not isinstance(dim, int) or dim % meta(x).dim() != 0:
        return None
    if op_name(split) == "unbind":
        return _Piece(x, j % n, j % n + 1, True)
    sizes = [p.shape[0] for p in parts]
    if not all(isinstance(s, int) for s in sizes) or sum(sizes) != n:
        return None
    return _Piece(x, sum(sizes[:j % len(sizes)]), sum(sizes[:j % len(sizes) + 1]), False)


class _Item:
    """The subgraph computing one item of the stack / cat, graph order, with its cell."""

    def __init__(self, root: Node, depends: dict[Node, bool]) -> None:
        self.nodes: list[Node] = []  # the ops (not the pieces)
        self.pieces: dict[Node, _Piece] = {}
        seen, work = set(), [root]
        while work:
            n = work.pop()
            if n in seen:
                continue
            seen.add(n)
            piece = _piece(n)
            if piece is not None:
                self.pieces[n] = piece
            elif _depends(n, depends):
                self.nodes.append(n)
                work.extend(n.all_input_nodes)
        order = {n: i for i, n in enumerate(root.graph.nodes)}
        self.nodes.sort(key=order.__getitem__)
        cells = {(p.start, p.stop, p.select) for p in self.pieces.values()}
        self.cell = cells.pop() if len(cells) == 1 else None

    def signature(self) -> Optional[list]:
        """The ops with their arguments, pieces named by source and internal nodes by position."""
        names = {n: ("node", i) for i, n in enumerate(self.nodes)}
        names.update({p: ("piece", piece.source) for p, piece in self.pieces.items()})
        sig = []
        for n in self.nodes:
            args = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: names.get(a, ("same", a)))
            sig.append((n.op, n.target, repr(args)))
        return sig


def _depends(n: Node, memo: dict[Node, bool]) -> bool:
    """Is ``n`` computed from a piece?  (Iterative: graphs are deep.)"""
    stack = [n]
    while stack:
        m = stack[-1]
        if m in memo:
            stack.pop()
            continue
        if _piece(m) is not None:
            memo[m] = True
            stack.pop()
            continue
        todo = [a for a in m.all_input_nodes if a not in memo]
        if todo:
            stack.extend(todo)
            continue
        memo[m] = any(memo[a] for a in m.all_input_nodes)
        stack.pop()
    return memo[n]


def _combined(node: Node) -> Optional[tuple[list[Node], bool]]:
    """(items, select) of a stack (of selects) / cat (of slices) along dim 0, else None."""
    name = op_name(node)
    if name not in ("stack", "cat") or node.op != "call_function" or not node.args:
        return None
    items, dim = node.args[0], node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, Node) for i in items) or dim != 0:
        return None
    return list(items), name == "stack"


def _ndim(x: Any) -> int:
    v = meta(x) if isinstance(x, Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else -1


def _why_not(n: Node, item: _Item, select: bool) -> Optional[str]:
    """Why the op ``n`` of an item does not act on each row on its own, or None."""
    if n.op not in ("call_function", "call_method") or mutates(n):
        return "has a side effect or changes a tensor in place"
    name = op_name(n)
    ours = [a for a in n.all_input_nodes if a in item.pieces or a in item.nodes]
    if name == "getitem":
        if isinstance(meta(n.args[0]), (tuple, list)):
            return None if isinstance(n.args[1], int) else "indexes a tuple by a value"
        return None if _index_keeps_rows(n.args[1], _ndim(n.args[0]), select) else "indexes the rows"
    if n.args[0] not in ours:
        return "reads a row slice in an argument other than its input"
    out = _ndim(n)
    if name in _ALONG:
        dims = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
        if name in ("max", "min") and isinstance(dims, Node):
            dims = None
        dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
        width = out if name == "unsqueeze" else _ndim(n.args[0])
        if not dims or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            return "has no dim argument the pass can read"
        if not select and any(d % max(width, 1) == 0 for d in dims):
            return "acts along the rows"
        at = _INDEXED.get(name)
        shared = [a for a in n.all_input_nodes if a not in ours]
        if shared or (at is not None and (len(n.args) <= at or n.args[at] not in ours)):
            return "reads a tensor that is not sliced with the rows"
        return None
    if not (pointwise_op(name) or name in _PLAIN or canon(n) == "convert"):
        return "is not known to act on each row on its own"
    for a in n.all_input_nodes:
        v = meta(a)
        if not isinstance(v, torch.Tensor):
            continue
        if a in ours and v.dim() != out:
            return "broadcasts a row slice of another rank"
        if a not in ours and not (v.dim() < out or (select and v.dim() == out) or (
                v.dim() == out and v.shape[0] == 1)):
            return f"reads {a.name}, which is not broadcast over the rows"
    return None


def _index_keeps_rows(index: Any, ndim: int, select: bool) -> bool:
    index = index if isinstance(index, tuple) else (index,)
    if not all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in index):
        return False
    if select:
        return True
    real = [i for i in index if i is not None and i is not Ellipsis]
    return index[0] == slice(None) or (index[0] is Ellipsis and len(real) < ndim)


def _shifted(n: Node, args: tuple, kwargs: dict, select: bool) -> tuple[tuple, dict]:
    """``n``'s arguments for the whole tensor: a select's dims (and indices) one to the right."""
    if not select:
        return args, kwargs
    name = op_name(n)
    if name == "getitem" and not isinstance(meta(n.args[0]), (tuple, list)):
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        index = index if index and index[0] is Ellipsis else (slice(None), *index)
        return (args[0], index), kwargs

    def shift(d: Any) -> Any:
        if isinstance(d, (list, tuple)):
            return type(d)(shift(e) for e in d)
        return d + 1 if isinstance(d, int) and d >= 0 else d

    if name in _ALONG:
        if "dim" in kwargs:
            return args, {**kwargs, "dim": shift(kwargs["dim"])}
        return (args[0], shift(args[1]), *args[2:]), kwargs
    return args, kwargs


def example_value(op: str, target: Any, args: tuple, kwargs: dict) -> Any:
    """What the call would give on the nodes' example values (under their fake mode)."""
    fake = torch.fx.node.map_arg((args, kwargs), meta)
    modes = {a.fake_mode for a in torch.utils._pytree.tree_leaves(fake)
             if isinstance(a, torch._subclasses.FakeTensor)}
    if len(modes) != 1:
        raise RuntimeError(f"expected one fake mode in example values, got {len(modes)}")
    with modes.pop():
        if op == "call_method":
            return getattr(fake[0][0], target)(*fake[0][1:], **fake[1])
        return target(*fake[0], **fake[1])


def _merge(graph: Graph, combine: Node, items: list[_Item], select: bool) -> Optional[Node]:
    """The ops of the first item on the whole tensors, before ``combine``; None (and the
    graph as it was) when the result is not the stack's / cat's."""
    first = items[0]
    new: dict[Node, Any] = {p: piece.source for p, piece in first.pieces.items()}
    made: list[Node] = []
    try:
        with graph.inserting_before(combine):
            for n in first.nodes:
                args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: new.get(a, a))
                args, kwargs = _shifted(n, args, kwargs, select)
                value = example_value(n.op, n.target, args, kwargs)
                m = graph.create_node(n.op, n.target, args, kwargs)
                made.append(m)
                m.meta.update({k: v for k, v in n.meta.items() if k in ("stack_trace", "nn_module_stack")})
                m.meta["example_value"] = value
                new[n] = m
    except Exception as e:  # (a shape the ops do not take: not the same ops on the whole)
        log.debug("chunked_logits: %s not merged: %s", combine.name, e)
        value = None
    out, want = (made[-1] if made else None), meta(combine)
    if value is None or not isinstance(value, torch.Tensor) or value.dtype != want.dtype or not same_shape(
            value.shape, want.shape):
        for m in reversed(made):
            graph.erase_node(m)
        return None
    return out


def _try(graph: Graph, combine: Node) -> bool:
    found = _combined(combine)
    if found is None:
        return False
    roots, select = found
    depends: dict[Node, bool] = {}
    items = [_Item(r, depends) for r in roots]
    if len(set(roots)) != len(roots) or not items[0].nodes or any(
            i.cell is None or i.cell[2] != select for i in items):
        return False
    sources = {p.source for i in items for p in i.pieces.values()}
    rows = {_rows(s) for s in sources}
    cells = [i.cell[:2] for i in items]
    if len(rows) != 1 or cells != list(zip([0, *(c[1] for c in cells[:-1])], [c[1] for c in cells])) or (
            cells[-1][1] != rows.pop() or cells[0][0] != 0):
        return False  # (the rows not covered exactly once, in order)
    sig = items[0].signature()
    inside = {n for i in items for n in i.nodes}
    if any(i.signature() != sig for i in items[1:]):
        return False
    for item in items:
        for n in item.nodes:
            if _why_not(n, item, select) is not None or any(
                    u not in inside and u is not combine for u in n.users):
                return False
        if any(u is not combine for u in item.nodes[-1].users):
            return False
    merged = _merge(graph, combine, items, select)
    if merged is None:
        return False
    combine.replace_all_uses_with(merged)
    splits = [p.args[0] for i in items for p in i.pieces if op_name(p.args[0]) in _SPLITS]
    dead = [combine, *(n for i in items for n in reversed(i.nodes)), *(p for i in items for p in i.pieces),
            *splits]
    erased: set[Node] = set()
    for n in dead:
        if n not in erased and not n.users:
            graph.erase_node(n)
            erased.add(n)
    return True


def merge_row_slices(graph: Graph) -> int:
    """Merge every loop over the rows (NOTE [row slices]) in ``graph``; how many were."""
    merged = 0
    for node in list(graph.nodes):
        if node.graph is graph and _try(graph, node):
            log.info("chunked_logits: %s merged: the same row-local ops on each slice of the rows, run on "
                     "the whole tensor", node.name)
            merged += 1
    return merged
