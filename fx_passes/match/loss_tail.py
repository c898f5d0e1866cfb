"""The loss tail of a fused lm_head region: from its per-row results to the graph's scalar loss.

The tail is taken when every node that depends on the region's call (its lse, token log-prob
and entropy per row) leads to the scalar loss the graph returns through row nodes, sums /
means over all rows, and an affine scalar part; then each row's cotangent for a unit loss is
known in the forward (:mod:`fx_passes.kernels.log_softmax.loss`).  Anything else is
:class:`NoTail`: the region keeps the recompute path.  See NOTE [loss tail nodes].
"""

# NOTE [loss tail nodes]
# A rewritten lm_head region is one call ``stats = lm_head_row_stats(hidden, weight, ...)``
# whose items ``stats[0..2]`` (lse, token log-prob, entropy per row) the rest of the graph
# reads.  When everything that reads them leads to the scalar loss the graph returns, and
# only so, each row's cotangent for a unit loss is known in the forward
# (:mod:`fx_passes.kernels.log_softmax.loss`).  The tail is taken when every node that depends
# on the region is one of:
#
# * *row* nodes: pointwise ops (ATen's ``pointwise`` tag, :func:`fx.graph_ops.op_name`),
#   conversions, ``detach`` / ``clone``, and views that keep one value per row in order
#   (``view`` / ``reshape`` / ``flatten`` / ``unsqueeze`` / ``squeeze``), whose every tensor
#   operand is a row node, a per-row tensor of the same shape that does not depend on the
#   region and needs no gradient (advantages, old log-probs, masks), or a 0-d tensor / number;
# * *reductions*: ``x.sum()`` / ``x.mean()`` of a floating row node over all its elements;
# * *scalar* nodes: the reductions combined affinely with values that do not depend on the
#   region (``+``, ``-``, negation, ``*`` by such a value, ``/`` by one: a masked mean's
#   ``/ mask.sum()``, an entropy bonus ``- c * ent.mean()``), ending in the loss.
#
# A per-row operand may also be broadcast to the rows (``adv.unsqueeze(1)``, ``[B, 1]`` read
# by ``[B, S]`` rows: TRL's GRPO advantages, one per sequence): NOTE [operands broadcast to
# the rows].
#
# The loss must be a 0-d floating tensor that requires grad and leaves the graph, and no
# other node of the tail (nor the stats) may be read outside it.  Anything else is
# :class:`NoTail`: the region keeps the recompute path.
#
# A row part that rounds to 16 bits is not taken either (NOTE [16-bit roundings in a tail]).

# NOTE [16-bit roundings in a tail]
# Stock Inductor runs a tail's row part and its sum as one fused kernel: each row's value
# stays in FP32 there (a cast to bf16 / fp16 inside the kernel is skipped, and so is a
# 16-bit op's rounding) and the sum is rounded once to its dtype.  The chunk loop runs the
# user's ops as written, so ``lp.bfloat16() * adv`` would round every row's value: a loss
# many times further from FP64 than stock's (``tests/test_op_rules.py``, the 16-bit tails).
# So the derivation declines, the reason in the log, and the tail stays in the graph for
# Inductor, when
#
# * a row node makes a bf16 / fp16 value, unless the op keeps the value as it is (a view,
#   ``detach``, ``clone``, ``neg``, ...) or converts a bool (exact);
# * a row node reads a bf16 / fp16 tensor the graph computes (``adv.bfloat16()``: stock
#   fuses that cast into the tail's kernel and skips it too), unless it is a converted bool.
#   A 16-bit input of the graph, read as it is, is its own exact value.
#
# (The two predicates are ``match/short_floats.py``'s, which the row-local regions share.)
# A sum over the rows in a 16-bit dtype (``x.sum(dtype=torch.bfloat16)``, a 16-bit scalar
# part) is one rounding of the FP64 sum, as stock's one rounding of its FP32 sum: taken.

# NOTE [operands broadcast to the rows]
# The chunk loops read a per-row operand one value per row, a chunk's rows at a time
# (``o.reshape(-1)[r0:r1]``).  An operand that a row node broadcasts to its rows (``[B, 1]``
# or ``[S]`` read by ``[B, S]``) has no such rows, so the match makes them: once the tail is
# matched, ``o.expand(rows)`` is added to the graph before its first reader, which reads it
# instead (a view: the program computes what it did, and the view stays if a later step
# declines the tail).  The loops then take it like any per-row operand (the call's
# ``reshape(-1)`` copies its ``T`` values: 4 bytes a row).  Its sizes are the rows' own: a
# symbolic size is read off a tensor the region already reads (the lm_head's hidden states, a
# per-row operand), else the tail is declined with the old reason.  Only the match's own
# operands change: an operand that needs a gradient is still declined.

# NOTE [values of several rows read back by a row]
# What reads per-token results that stay in the graph (``match_reads``; ``match_region_reads``
# without collectives) is not a loss to derive: the graph keeps its ops, and the skip graph
# (``match/row_mask.py``) only asks, per row, whether leaving the row out changes a value
# the graph reads.  So these readers may also sum rows over some dims (``(x * m).sum(-1)``,
# a mean per sequence) and compute anything pure from sums (GSPO's ``exp`` of a sequence's
# mean log-ratio, a sequence's normalisation, verl's clip fraction and approximate KL).
# The skip graph asks of a sum over some dims what it asks of a sum over all rows: the row
# adds exactly 0 and gets an exactly-zero cotangent (its incoming gradient taken as a
# finite number: NOTE [per-token rows a mask leaves out]).  Where every sum holds that,
# every value computed from sums is stock's, so it needs no fact; a row that reads one back
# (``ratio * adv`` broadcast to the tokens) knows it by no bound (``[-inf, inf]``, maybe NaN:
# never a zero, a condition or a divisor's distance from 0; ``tail_facts._Interpreter.derived``),
# and must give it exactly 0 of gradient back: its own cotangent exactly 0 and its
# derivative in that value finite (``0 * inf`` there would turn the value's gradient NaN on
# every row of its sequence in stock's program alone; ``_Interpreter._passes_back_zero``).
# A comparison (``torch.gt(pg2, pg1)``) is 0 or 1 and passes no gradient (``Kind.COMPARE``).
# A row value computed from such a value and the row's own results through ops whose value
# is the same in both programs on a row left out (verl's GSPO: ``lp - lp.detach() + seq``)
# is read as that (NOTE [the same value in both programs] in ``match/tail_facts.py``).
# A loss to derive (``match_loss_tail``) keeps its affine scalar part; a vocab-parallel
# call's readers (collectives) keep the rules as they were.

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch.fx import Graph, Node

from ..fx.emitter import Emitter
from ..fx.graph_ops import (
    canon,
    is_collective,
    is_pure,
    is_scalar,
    meta,
    op_name,
    requires_grad,
    same,
    same_shape,
)
from ..fx.op_rules import FLOATS, Kind, tail_row_rule, tail_rule
from ..kernels.log_softmax.lm_head import lm_head_row_stats
from .short_floats import VIEWS, computed_short, rounds_to_16_bits

__all__ = ["LossTail", "NoTail", "match_loss_tail", "match_tail", "match_reads", "match_region_reads",
           "VIEWS"]

ROW, REDUCE, SCALAR = "row", "reduce", "scalar"


class NoTail(Exception):
    """The region's results do not reach the loss as a loss tail (the message says why)."""


@dataclasses.dataclass
class LossTail:
    """A matched tail (graph order throughout)."""

    stats: Node  # the fused call (lm_head_row_stats, or a row-local region's row_local_sweeps)
    items: dict[Node, int]  # stats[i] nodes -> i (lm_head_row_stats: 0 lse, 1 logprob, 2 entropy)
    rows: list[Node]  # row nodes (not the items)
    reductions: list[Node]
    scalars: list[Node]  # scalar nodes, the loss last (empty when the loss is a reduction)
    loss: Node
    row_operands: list[Node]  # per-row tensors that do not depend on the region
    whole: list[Node]  # 0-d tensors and numbers the graph computes, read by the tail
    sizes: list[Node] = dataclasses.field(default_factory=list)  # of whole: an item's size(0) / numel()
    leaving: list[Node] = dataclasses.field(default_factory=list)  # (match_reads) what leaves the graph

    @property
    def nodes(self) -> list[Node]:
        return [self.stats, *self.items, *self.rows, *self.reductions, *self.scalars]

    def describe(self) -> str:
        ops = {op_name(n) for n in self.rows + self.scalars} - {""}
        ops = sorted(ops | {op_name(r) for r in self.reductions})
        return f"loss tail ({', '.join(ops)}) over {len(self.row_operands)} per-row tensor(s)"


def _is_stats(node: Node) -> bool:
    return node.op == "call_function" and node.target is lm_head_row_stats


def _tensor(value: Any) -> torch.Tensor | None:
    v = meta(value)
    return v if isinstance(v, torch.Tensor) else None


class _Matcher:
    def __init__(self, stats: Node, rows_numel: Any) -> None:
        self.stats, self.n = stats, rows_numel
        self.kind: dict[Node, str] = {}
        self.row_operands: dict[Node, None] = {}
        self.broadcast: dict[Node, Any] = {}  # a row operand broadcast to the rows -> the rows' shape
        self.whole: dict[Node, None] = {}
        self.collectives = False  # an all_reduce / wait_tensor of per-row values is a row node
        self.derive = False  # a loss tail to derive: no 16-bit rounding (NOTE [16-bit roundings in a tail])
        self.loose = False  # reads (no collective): NOTE [values of several rows read back by a row]

    def operand(self, node: Node, a: Node, per_row_shape: Any) -> None:
        """``a`` (not in the tail) read by ``node``: a per-row tensor of ``per_row_shape``
        (None: none allowed) or a value read whole; neither may need a gradient."""
        if requires_grad(a):
            raise NoTail(f"{node.name} reads {a.name}, which needs a gradient the fused op would not give")
        if is_scalar(a):
            self.whole[a] = None
            return
        t = _tensor(a)
        if t is None:
            raise NoTail(f"{node.name} reads {a.name}, which is not a tensor or a number")
        if t.dim() == 0:
            self.whole[a] = None
        elif per_row_shape is not None and same_shape(t.shape, per_row_shape):
            self.row_operands[a] = None
        elif per_row_shape is not None and _broadcasts(t.shape, per_row_shape) and \
                same_shape(self.broadcast.setdefault(a, per_row_shape), per_row_shape):
            self.row_operands[a] = None  # (NOTE [operands broadcast to the rows])
        else:
            raise NoTail(f"{node.name} reads {a.name} {tuple(t.shape)}: neither one value per row of the "
                         "region in the result's shape nor a 0-d tensor")

    def _collective(self, node: Node) -> bool:
        """A functional all-reduce / wait of per-row values, where those are row nodes."""
        return self.collectives and is_collective(node) \
            and op_name(node).split(".")[0] in ("all_reduce", "wait_tensor")

    def classify(self, node: Node) -> str:
        if not is_pure(node) and not self._collective(node):
            raise NoTail(f"{node.name} has a side effect or changes a tensor in place")
        name, out = op_name(node), _tensor(node)
        if out is None:
            raise NoTail(f"{node.name} ({name}) does not make one tensor")
        inner = [a for a in node.all_input_nodes if a in self.kind]
        kinds = {self.kind[a] for a in inner}
        if kinds == {ROW} or (self.loose and ROW in kinds):
            return self._row_side(node, name, out, inner)
        if ROW in kinds:
            raise NoTail(f"{node.name} ({name}) mixes per-row values with a sum over the rows")
        if self.loose:
            return self._derived(node)
        return self._scalar_side(node, name, out, inner)

    def _row_side(self, node: Node, name: str, out: torch.Tensor, inner: list[Node]) -> str:
        src = _tensor(inner[0])
        if name in ("sum", "mean") and (out.dim() == 0 or self.loose):
            why = tail_rule(node, name)[1]  # (fx/op_rules.py: the one table of what ops mean)
            if why and self.loose:  # (a sum over some dims: NOTE [values of several rows read back by a row])
                why = _partial_sum_why(node)
            if why:
                raise NoTail(f"{node.name}: {why}")
            if not src.is_floating_point():
                raise NoTail(f"{node.name} sums a tensor of {src.dtype}")
            return REDUCE
        if not same(out.numel(), self.n) or out.device != src.device:
            raise NoTail(f"{node.name} ({name}) makes {tuple(out.shape)}, not one value per row of the "
                         "region")
        if self._collective(node):
            return ROW
        if name in VIEWS:
            if node.all_input_nodes != [inner[0]] and name in ("view", "reshape"):
                raise NoTail(f"{node.name} reshapes to a size the graph computes")
            return ROW
        if not (tail_row_rule(name) or canon(node) == "convert"):
            raise NoTail(f"{node.name} ({name}) is not a pointwise op on the rows (fx/op_rules.py)")
        if self.derive and rounds_to_16_bits(node) is not None:
            raise NoTail(f"{node.name} ({name}) rounds each row's value to {out.dtype}, where stock's fused "
                         "kernel keeps FP32 and rounds the sum once (NOTE [16-bit roundings in a tail])")
        for a in node.all_input_nodes:
            if a in self.kind and self.kind[a] != ROW:  # (loose: a value of several rows, read back)
                shape = _tensor(a).shape
                if not _broadcasts(shape, out.shape) and not same_shape(shape, out.shape):
                    raise NoTail(f"{node.name} broadcasts {a.name} {tuple(shape)} to {tuple(out.shape)}")
            elif a in self.kind:
                t = _tensor(a)
                if t.dim() and not same_shape(t.shape, out.shape):
                    raise NoTail(f"{node.name} broadcasts {a.name} {tuple(t.shape)} to {tuple(out.shape)}")
            else:
                self.operand(node, a, out.shape)
                if self.derive and computed_short(a):
                    raise NoTail(f"{node.name} reads {a.name}, {_tensor(a).dtype} the graph computes: stock "
                                 "fuses it into the tail's kernel, FP32 (NOTE [16-bit roundings in a tail])")
        return ROW

    def _derived(self, node: Node) -> str:
        """(loose) A node computed from sums of the rows and values that are not the rows'
        (NOTE [values of several rows read back by a row]): any pure op; the tensors it
        reads are kept as values read whole (a mask's count is how ``masks_among`` knows a
        floating mask)."""
        for a in node.all_input_nodes:
            if a not in self.kind and (is_scalar(a) or _tensor(a) is not None):
                self.whole[a] = None
        return SCALAR

    def _scalar_side(self, node: Node, name: str, out: torch.Tensor, inner: list[Node]) -> str:
        if out.dim() != 0 or not out.is_floating_point():
            raise NoTail(f"{node.name} ({name}) makes {tuple(out.shape)} {out.dtype} from the loss's sums")
        rule, why = tail_rule(node, name)  # (fx/op_rules.py: the one table of what ops mean)
        if rule is None or rule.kind is Kind.REDUCE_ROWS:
            raise NoTail(f"{node.name} ({name}) is not affine in the sums over the rows: "
                         f"{why or 'a reduction of a sum'}")
        tensors = [a for a in node.args if isinstance(a, Node)]
        if name == "mul" and len([a for a in tensors if a in self.kind]) > 1:
            raise NoTail(f"{node.name} multiplies two sums over the rows")
        if name == "div" and (len(node.args) < 2 or node.args[1] in self.kind):
            raise NoTail(f"{node.name} divides by a sum over the rows")
        if any(isinstance(v, Node) for v in node.kwargs.values()):
            raise NoTail(f"{node.name} ({name}) takes a tensor keyword argument")
        for a in node.all_input_nodes:
            if a not in self.kind:
                self.operand(node, a, None)
        return SCALAR


def match_loss_tail(graph: Graph, stats: Node, ignore: frozenset = frozenset()) -> LossTail:
    """The loss tail of the fused lm_head call ``stats``, or :class:`NoTail` (``ignore``:
    nodes that read the region but nothing reads, which the rewrite erases: a per-sequence
    sum ``rewrite/group_sums.py`` rewrote)."""
    if not _is_stats(stats):
        raise NoTail(f"{stats.name} is not a fused lm_head call")
    if len(stats.args) != 10:
        raise NoTail("the graph returns the logits too")
    return match_tail(graph, stats, range(3), ignore)


def match_tail(graph: Graph, stats: Node, results: range, ignore: frozenset = frozenset()) -> LossTail:
    """The loss tail of the fused call ``stats``, whose items ``results`` are one value
    per row each, or :class:`NoTail` (``ignore``: :func:`match_loss_tail`'s)."""
    return _match(graph, stats, results, reads=False, ignore=ignore)


def match_reads(graph: Graph, stats: Node, ignore: frozenset = frozenset()) -> LossTail:
    """What reads a fused lm_head call that keeps its per-token results (no loss in the
    call): the same kinds of node as a loss tail, but any number of values may leave the
    graph, per row or not, with or without a gradient (``leaving``; ``loss`` is the last
    of them).  Its skip graph (:mod:`fx_passes.match.row_mask`) decides, per row, whether
    the results' values matter; :class:`NoTail` when another kind of node reads them
    (``ignore``: :func:`match_loss_tail`'s)."""
    if not _is_stats(stats) or len(stats.args) != 10:
        raise NoTail("the call returns the logits too" if _is_stats(stats)
                     else f"{stats.name} is not a fused call")
    return _match(graph, stats, range(3), reads=True, ignore=ignore)


def match_region_reads(graph: Graph, call: Node, n_results: int, collectives: bool = False,
                       ignore: frozenset = frozenset()) -> LossTail:
    """:func:`match_reads` of a row-local call (``row_local_sweeps``) whose ``n_results``
    per-row results the graph keeps; :class:`NoTail` when another kind of node reads them.
    ``collectives``: a functional ``all_reduce`` / ``wait_tensor`` of per-row values is a
    row node (a vocab-parallel call's readers)."""
    return _match(graph, call, range(n_results), reads=True, collectives=collectives, ignore=ignore)


def _match(graph: Graph, stats: Node, results: range, reads: bool, collectives: bool = False,
           ignore: frozenset = frozenset()) -> LossTail:
    items: dict[Node, int] = {}
    for u in stats.users:
        i = u.args[1] if u.target is operator.getitem and len(u.args) == 2 else None
        if i not in results:
            raise NoTail(f"{u.name} reads the fused call's results")
        items[u] = i
    if not items:
        raise NoTail("nothing reads the region's results")
    read = [_tensor(u) for u in items]
    if any(t is None for t in read) or not all(same(t.numel(), read[0].numel()) for t in read):
        raise NoTail("the results the graph reads are not one value per row each")
    m = _Matcher(stats, read[0].numel())
    m.collectives, m.derive, m.loose = collectives, not reads, reads and not collectives
    m.kind.update(dict.fromkeys(items, ROW))
    order = {n: i for i, n in enumerate(graph.nodes)}
    found, stack = set(items), list(items)
    sizes = [u for item in items for u in item.users if _row_count(u, item)]
    while stack:
        for u in stack.pop().users:
            if u.op != "output" and u not in found and u not in sizes and u not in ignore:
                found.add(u)
                stack.append(u)
    for node in sorted(found - set(items), key=order.__getitem__):
        m.kind[node] = m.classify(node)
    leaving = sorted((n for n in found if any(u.op == "output" for u in n.users)), key=order.__getitem__)
    if reads and leaving:
        _expand_broadcasts(graph, m, [*stats.all_input_nodes, *m.row_operands], order)
        nodes = sorted(found - set(items), key=order.__getitem__)
        of = {kind: [n for n in nodes if m.kind[n] == kind] for kind in (ROW, REDUCE, SCALAR)}
        return LossTail(stats, items, of[ROW], of[REDUCE], of[SCALAR], leaving[-1], list(m.row_operands),
                        list(m.whole), [s for s in sizes if s in m.whole], leaving)
    if len(leaving) != 1 or m.kind[leaving[0]] == ROW:
        raise NoTail(f"{len(leaving)} value(s) of the region leave the graph"
                     if len(leaving) != 1 else f"{leaving[0].name}, one value per row, leaves the graph")
    loss = leaving[0]
    if not requires_grad(loss):
        raise NoTail(f"the loss {loss.name} needs no gradient")
    _expand_broadcasts(graph, m, [*stats.all_input_nodes, *m.row_operands], order)  # (matched: the last step)
    nodes = sorted(found - set(items), key=order.__getitem__)
    of = {kind: [n for n in nodes if m.kind[n] == kind] for kind in (ROW, REDUCE, SCALAR)}
    return LossTail(stats, items, of[ROW], of[REDUCE], of[SCALAR], loss, list(m.row_operands), list(m.whole),
                    [s for s in sizes if s in m.whole])


def _partial_sum_why(node: Node) -> str:
    """Why a sum / mean over some dims (``x.sum(-1)``, ``torch.mean(x, dim=(0, 1),
    keepdim=True)``, a floating ``dtype``) is not read as one; "" where it is."""
    args, kwargs = list(node.args[1:]), dict(node.kwargs)
    names = ["dim", "keepdim", "dtype"]
    if len(args) > len(names) or set(kwargs) - set(names) - {"input"}:
        return f"{op_name(node)} with arguments the rule does not read"
    given = {**dict(zip(names, args)), **kwargs}
    dim = given.get("dim")
    dims = dim if isinstance(dim, (tuple, list)) else [dim]
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return f"{op_name(node)} over dims {dim!r}"
    if not isinstance(given.get("keepdim", False), bool) or given.get("dtype") not in (None, *FLOATS):
        return f"{op_name(node)} with keepdim {given.get('keepdim')!r}, dtype {given.get('dtype')!r}"
    return ""


def _broadcasts(shape: Any, rows: Any) -> bool:
    """Does a tensor of ``shape`` broadcast to ``rows`` (and is not of that shape)?"""
    if len(shape) > len(rows) or same_shape(shape, rows):
        return False
    return all(same(s, 1) or same(s, r) for s, r in zip(reversed(shape), reversed(rows)))


def _expand_broadcasts(graph: Graph, m: _Matcher, known: list[Node], order: dict[Node, int]) -> None:
    """Each operand broadcast to the rows becomes ``o.expand(rows)``, read by its row nodes
    instead (NOTE [operands broadcast to the rows]); the sizes are numbers or read off
    ``known`` tensors before its first reader; :class:`NoTail` (nothing changed) where a
    size is in neither."""
    plans = {}
    for a, shape in m.broadcast.items():
        readers = sorted((u for u in a.users if m.kind.get(u) == ROW), key=order.__getitem__)
        sizes = _sizes(shape, [k for k in known if order.get(k, len(order)) < order[readers[0]]], m)
        if sizes is None:
            raise NoTail(f"{a.name} {tuple(_tensor(a).shape)} is broadcast to the rows {tuple(shape)}, "
                         "whose sizes no tensor of the region gives")
        plans[a] = readers, sizes
    for a, (readers, sizes) in plans.items():
        emit = Emitter(graph, readers[0])
        sized = [emit.method("size", *size) if isinstance(size, tuple) else size for size in sizes]
        expanded = emit.method("expand", a, *sized)
        for u in readers:
            u.replace_input_with(a, expanded)
        m.row_operands = {(expanded if o is a else o): None for o in m.row_operands}


def _sizes(shape: Any, known: list[Node], m: _Matcher) -> list | None:
    """``shape``'s sizes: each a number, or ``(tensor, dim)`` of a ``known`` tensor (not
    a tail node) of that size; None where one is neither."""
    out = []
    for size in shape:
        if isinstance(size, int):
            out.append(size)
            continue
        found = next(((k, d) for k in known if (t := _tensor(k)) is not None and k not in m.broadcast
                      for d, s in enumerate(t.shape) if same(s, size)), None)
        if found is None:
            return None
        out.append(found)
    return out


def _row_count(node: Node, item: Node) -> bool:
    """``item.size(0)`` or ``item.numel()`` of a one-dimensional item (a mean's count of
    rows): a number the rewrite computes from the hidden states instead."""
    t = _tensor(item)
    if t is None or t.dim() != 1 or node.all_input_nodes != [item] or node.kwargs:
        return False
    name = op_name(node)
    return (name == "numel" and len(node.args) == 1) or (name == "size" and node.args[1:] in ((0,), (-1,)))
