"""Sums per sequence in a loss tail, made one sum over the rows (NOTE [per-sequence sums]).
A loop over packed sequences (a ``split`` of the rows, Python's ``sum``) too.

TRL's ``"grpo"`` loss and verl's ``"seq-mean-token-mean"`` normalise each sequence by its own
token count before the mean over the sequences,
``((x * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()``: a sum over a sequence's rows, which
the loss tail (:mod:`fx_passes.match.loss_tail`) does not take.  :func:`regroup` writes the
same loss as one sum over the rows, which it takes; :class:`Regrouped` undoes that where
the tail is declined after all.
"""

# NOTE [per-sequence sums]
# A loss tail may sum its per-row values per group of rows (``x.sum(-1)`` of ``[B, S]``: per
# sequence, over trailing dims), combine each group's sum with values that do not depend on
# the region by the ops of the tail's scalar part (``* c``, ``/ c``, ``+ c``, ``-``, a
# conversion), one group value each, and then sum or average those over all groups:
#
#     R = sum_b (a_b * sum_s x[b, s] + d_b)     (/ B for a mean)
#       = sum_{b, s} a_b * x[b, s] + sum_b d_b
#
# So R is one sum over the rows of ``x * a`` (``a`` broadcast to the rows, NOTE [operands
# broadcast to the rows]) plus a value that does not depend on the region: a loss tail.
# :func:`regroup` rewrites such chains so (``a`` and ``d`` computed in the graph from the
# user's own operands, in the chain's order), and the match then takes the tail
# (``ignore``: the old chain, dead until :meth:`Regrouped.commit` erases it).  Where the tail
# is declined after all, :meth:`Regrouped.undo` restores the user's graph: the program stock
# Inductor then compiles is the user's own.  Numerics: stock rounds each group's FP32 sum,
# then each quotient, then their mean; the loop forms one FP32 product ``x * a_b`` a row and
# sums those in FP64 (``tests/test_group_sums.py``: no further from FP64 than stock).  A mean
# per group (``x.mean(-1)``) is a sum over ``S``; where a size is symbolic and needed (``S``,
# the ``B`` groups a constant ``d`` is summed over or a mean averages) it is read off an
# operand of the chain with that many elements or a dim of the region's inputs (the hidden
# states'), else the chain is left as it is.  An operand of the chain is a tensor of one
# value a group or a 0-d one: a symbolic number there leaves the chain as it is.
#
# The groups may also be the items of a ``split`` of the rows into static sizes: a loop
# over packed sequences (miles' ``sum_of_sample_mean``, ``sum((x_i * m_i).sum() /
# m_i.sum().clamp_min(1) for x_i, m_i in zip(x.split(lengths), masks))``).  Each item's
# values times one operand not of the region (its mask), summed or averaged whole, then an
# affine chain of 0-d values, and the items' values added one after another (Python's
# ``sum``, numbers beside them): ``(x * m * cat(a_i)).sum() + sum(d_i)`` (:func:`_rewrite_split`),
# ``m`` the mask the items' operands were split from (so that the rows it zeroes are the rows
# a loss leaves out, NOTE [rows a loss leaves out]) or their ``cat``.  An empty item's mean
# (NaN) leaves the loop as it is.

from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
from torch._dynamo.utils import counters
from torch.fx import Graph, Node

from ..fx.emitter import Emitter
from ..fx.graph_ops import keep_meta, meta, op_name, requires_grad, same, same_shape
from ..fx.op_rules import Kind, tail_rule

__all__ = ["Regrouped", "regroup", "match_regrouped", "committed"]

COUNTER = "chunked_logits"


class Regrouped:
    """The chains :func:`regroup` rewrote: ``dead`` (the user's nodes, still in the graph
    and read by nothing), :meth:`undo` and :meth:`commit`."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.added: list[Node] = []
        self.swaps: list[tuple[Node, Node]] = []  # (the user's reduction, the sum over the rows)
        self.chains: list[list[Node]] = []

    @property
    def dead(self) -> set[Node]:
        return {n for chain in self.chains for n in chain}

    def undo(self) -> None:
        """The user's graph back: each reduction read again, the added nodes erased."""
        for old, new in self.swaps:
            new.replace_all_uses_with(old)
        gone = set(self.added)  # (and what a match added on them since: an expand to the rows)
        for n in reversed(list(self.graph.nodes)):
            if n in gone or (not n.users and any(a in gone for a in n.all_input_nodes)):
                gone.add(n)
                self.graph.erase_node(n)
        self.added, self.swaps, self.chains = [], [], []

    def commit(self) -> None:
        """The user's chains erased (the tail is taken: nothing reads them)."""
        for chain in self.chains:
            for n in reversed(chain):
                self.graph.erase_node(n)
        self.chains = []


def regroup(graph: Graph, stats: Node) -> Optional[Regrouped]:
    """Each chain below the fused call ``stats`` that sums per group of rows and then over
    the groups (NOTE [per-sequence sums]) rewritten as one sum over the rows; None where
    there is none (the graph unchanged)."""
    region, stack = set(), [stats]
    while stack:
        for u in stack.pop().users:
            if u not in region:
                region.add(u)
                stack.append(u)
    order = {n: i for i, n in enumerate(graph.nodes)}
    done = Regrouped(graph)
    known = [n for n in stats.all_input_nodes if isinstance(meta(n), torch.Tensor)]
    for p in sorted(region, key=order.__getitem__):
        if p in done.dead:
            continue
        found = _chain(p, region)
        if found is not None:
            _rewrite(done, *found, known)
            continue
        items = _split_items(p, region, order)
        if items is not None:
            _rewrite_split(done, p, *items, known)
    return done if done.swaps else None


def _args(node: Node) -> list:
    """The operands in the op's own order (``c / x`` for ``x.__rtruediv__(c)``)."""
    args = list(node.args)
    if node.op == "call_method" and str(node.target).startswith("__r") and op_name(node) != "rsub":
        args.reverse()
    return args


def _partial(p: Node, region: set[Node]) -> Optional[tuple[Node, list[int]]]:
    """``(x, dims)`` of ``p = x.sum(dims)`` / ``x.mean(dims)`` over trailing dims of a
    floating ``x`` of the region, some dims left; else None."""
    if op_name(p) not in ("sum", "mean") or p.op not in ("call_method", "call_function") or not p.args:
        return None
    x, kwargs = p.args[0], dict(p.kwargs)
    dims = p.args[1] if len(p.args) > 1 else kwargs.pop("dim", None)
    keepdim = p.args[2] if len(p.args) > 2 else kwargs.pop("keepdim", False)
    xt, out = meta(x), meta(p)
    if x not in region or dims is None or keepdim or kwargs or len(p.args) > 3:
        return None
    if not isinstance(xt, torch.Tensor) or not isinstance(out, torch.Tensor) or not xt.is_floating_point():
        return None
    dims = [dims] if isinstance(dims, int) else list(dims) if isinstance(dims, (list, tuple)) else None
    if not dims or not all(isinstance(d, int) for d in dims):
        return None
    dims = sorted(d % xt.dim() for d in dims)
    if dims != list(range(xt.dim() - len(dims), xt.dim())) or len(dims) == xt.dim():
        return None
    return x, dims


def _chain(p: Node, region: set[Node]) -> Optional[tuple]:
    """``(p, x, dims, chain, final)``: ``p`` sums per group (:func:`_partial`), each node of
    ``chain`` is a scalar-part op of the previous one's group values (its other operand
    not of the region, no gradient, the group shape kept), and ``final`` sums or averages
    the last over all groups; else None.  The other operands are numbers, 0-d tensors
    or one value a group."""
    part = _partial(p, region)
    if part is None:
        return None
    chain, cur, shape = [], p, meta(p).shape
    while True:
        if len(cur.users) != 1:
            return None
        (u,) = cur.users
        name, out = op_name(u), meta(u)
        rule, _ = tail_rule(u, name)
        if rule is None or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return None
        if rule.kind is Kind.REDUCE_ROWS:
            if u.args[0] is not cur or len(u.args) > 1 or out.dim() != 0:
                return None
            return p, *part, chain, u
        args, others = _args(u), [a for a in u.all_input_nodes if a is not cur]
        if not same_shape(out.shape, shape) or u.kwargs or cur not in args[:2] or args[:2].count(cur) != 1 \
                or any(a in region or requires_grad(a) for a in others):
            return None
        if not all(_per_group(a, shape) for a in others):
            return None
        if rule.kind is Kind.SAME and out.dtype != meta(cur).dtype:
            return None  # (a rounding between the sums: not one sum of the rows)
        if rule.kind is Kind.FACTOR and name == "div" and args[0] is not cur:
            return None
        chain.append(u)
        cur = u


def _per_group(a: Node, shape: Any) -> bool:
    """Is ``a`` one value a group or one for all (``a`` and ``d`` then of those shapes)?  A
    symbolic number is neither (a node's example value needs a tensor)."""
    t = meta(a)
    return isinstance(t, torch.Tensor) and (t.dim() == 0 or same_shape(t.shape, shape))


class _Coefficients:
    """``a`` and ``d`` of ``a * sum + d`` (numbers, or nodes of the graph added by ``emit``)."""

    def __init__(self, emit: Emitter) -> None:
        self.emit, self.a, self.d = emit, 1.0, 0.0

    def op(self, fn, x: Any, y: Any) -> Any:
        if not isinstance(x, Node) and not isinstance(y, Node):
            return fn(x, y)
        if fn in (operator.mul, operator.truediv) and not isinstance(x, Node) and x == 0.0:
            return 0.0  # (d of a chain with no sum of terms yet: 0 times anything read)
        if fn is operator.mul and not isinstance(x, Node) and x == 1.0:
            return y
        if fn in (operator.mul, operator.truediv) and not isinstance(y, Node) and y == 1.0:
            return x
        if fn in (operator.add, operator.sub) and not isinstance(y, Node) and y == 0.0:
            return x
        if fn is operator.add and not isinstance(x, Node) and x == 0.0:
            return y
        return self.emit.function(fn, x, y)

    def step(self, node: Node, cur: Node) -> None:
        name, args = op_name(node), _args(node)
        kind = tail_rule(node, name)[0].kind
        other = next((a for a in args[:2] if a is not cur), None)
        if kind is Kind.FACTOR:
            fn = operator.mul if name == "mul" else operator.truediv
            self.a, self.d = self.op(fn, self.a, other), self.op(fn, self.d, other)
        elif kind is Kind.NEGATE:
            self.a, self.d = self.op(operator.mul, -1.0, self.a), self.op(operator.mul, -1.0, self.d)
        elif kind is Kind.SUM_OF_TERMS and name == "add":
            self.d = self.op(operator.add, self.d, other)
        elif kind is Kind.SUM_OF_TERMS and (args[0] is cur) == (name == "sub"):
            self.d = self.op(operator.sub, self.d, other)  # (cur - other: sub(cur, other), rsub(other, cur))
        elif kind is Kind.SUM_OF_TERMS:  # other - cur
            self.a, self.d = self.op(operator.mul, -1.0, self.a), self.op(operator.sub, other, self.d)


def _count(shape: Any, like: list[Node]) -> Optional[list]:
    """The number of groups (the elements of ``shape``) as factors to multiply: numbers,
    ``(t,)`` (the elements of a tensor ``t`` of ``like`` that has that many) or ``(t, d)``
    (dim ``d`` of one of that size); None where a symbolic size is in none of them."""
    total = math.prod(shape)
    if isinstance(total, int):
        return [total]
    for n in like:
        t = meta(n)
        if isinstance(t, torch.Tensor) and same(t.numel(), total):
            return [(n,)]
    factors = []
    for size in shape:
        found = size if isinstance(size, int) else next(
            ((n, d) for n in like if isinstance(t := meta(n), torch.Tensor)
             for d, s in enumerate(t.shape) if same(s, size)), None)
        if found is None:
            return None
        factors.append(found)
    return factors


def _rewrite(done: Regrouped, p: Node, x: Node, dims: list[int], chain: list[Node], final: Node,
             known: list[Node]) -> None:
    """``final`` read as one sum over the rows (NOTE [per-sequence sums]), where the sizes
    it needs are known (``known``: tensors before the region that may give them; else the
    chain is left as it is)."""
    groups = meta(p)
    operands = [a for n in chain for a in n.all_input_nodes if a not in (p, *chain)]
    count = _count(groups.shape, operands + known)
    per_mean = _count([meta(x).shape[d] for d in dims], known) if op_name(p) == "mean" else []
    if per_mean is None:
        return
    emit = Emitter(done.graph, final)
    c = _Coefficients(emit)
    cur = p
    for node in chain:
        c.step(node, cur)
        cur = node
    whole_d = isinstance(c.d, Node) and same_shape(meta(c.d).shape, groups.shape)
    if count is None and (op_name(final) == "mean" or not (whole_d or c.d == 0.0)):
        for n in reversed(emit.added):  # (the coefficients made so far: the chain stays as it is)
            done.graph.erase_node(n)
        return

    def by_each(t: Any, factors: list, fn) -> Any:
        """``t`` (a tensor node or a number) times / over each factor in turn (a symbolic
        size only ever with a tensor: a node's example value needs one)."""
        for f in factors:
            f = f if isinstance(f, int) else emit.method("numel" if len(f) == 1 else "size", *f)
            if not isinstance(t, Node) and isinstance(f, Node):
                t = emit.method("new_full", x, (), t)
            t = c.op(fn, t, f)
        return t
    scale = c.a
    if isinstance(scale, Node) and meta(scale).dim():
        for _ in dims:
            scale = emit.method("unsqueeze", scale, -1)
    rows = by_each(c.op(operator.mul, x, scale), per_mean, operator.truediv)  # (a mean per group)
    total = emit.method("sum", rows, **final.kwargs)
    if whole_d:
        total = emit.function(operator.add, total, emit.method("sum", c.d))
    elif isinstance(c.d, Node) or c.d != 0.0:
        total = emit.function(operator.add, total, by_each(c.d, count, operator.mul))
    if op_name(final) == "mean":
        total = by_each(total, count, operator.truediv)
    keep_meta(total, final)  # (its value's metadata, and the user's line for the log)
    final.replace_all_uses_with(total)
    done.added += emit.added
    done.swaps.append((final, total))
    done.chains.append([p, *chain, final])


def _split_items(p: Node, region: set[Node], order: dict[Node, int]) -> Optional[tuple]:
    """``(x, dim, sizes, items, fold)`` where ``p = x.split(sizes, dim)`` splits a floating
    ``x`` of the region into groups of rows (NOTE [per-sequence sums], a loop over packed
    sequences), each item ``(item, operand, reduce, chain)`` is the group's values, times
    one ``operand`` not of the region (or None), summed (or averaged) whole, then a
    scalar-part chain of values not of the region, and ``fold`` adds the items' last
    values together, one after another (Python's ``sum``), with numbers; else None."""
    if op_name(p) != "split" or p.op not in ("call_method", "call_function") or len(p.args) < 2:
        return None
    x, sizes, kwargs = p.args[0], p.args[1], dict(p.kwargs)
    dim = p.args[2] if len(p.args) > 2 else kwargs.pop("dim", 0)
    xt = meta(x)
    if x not in region or kwargs or not isinstance(xt, torch.Tensor) or not xt.is_floating_point() \
            or not isinstance(dim, int) or dim % max(xt.dim(), 1) != 0:
        return None
    if isinstance(sizes, int) and isinstance(xt.shape[0], int) and sizes > 0:
        sizes = [min(sizes, xt.shape[0] - a) for a in range(0, xt.shape[0], sizes)]
    if not isinstance(sizes, (list, tuple)) or not all(isinstance(n, int) for n in sizes):
        return None
    getitems = {u.args[1]: u for u in p.users if u.target is operator.getitem and isinstance(u.args[1], int)}
    if len(getitems) != len(p.users) or sorted(getitems) != list(range(len(sizes))):
        return None
    items, lasts = [], []
    for i in range(len(sizes)):
        item = _split_item(getitems[i], region)
        if item is None or (op_name(item[2]) == "mean" and not isinstance(_numel(item[0]), int)):
            return None
        if op_name(item[2]) == "mean" and _numel(item[0]) == 0:
            return None  # (an empty item's mean is NaN)
        items.append(item)
        lasts.append(item[-1][-1] if item[-1] else item[2])
    fold = _fold(lasts, order)
    return None if fold is None else (x, dim, list(sizes), items, fold)


def _split_item(g: Node, region: set[Node]) -> Optional[tuple]:
    """``(g, operand, reduce, chain)`` of one item of a split (:func:`_split_items`)."""
    shape, cur, operand = meta(g).shape, g, None
    if len(cur.users) != 1:
        return None
    (u,) = cur.users
    if op_name(u) == "mul" and not u.kwargs and len(u.args) == 2 and u.args.count(cur) == 1:
        operand = next(a for a in u.args if a is not cur)
        t = meta(operand)
        if not isinstance(operand, Node) or operand in region or requires_grad(operand) \
                or not isinstance(t, torch.Tensor) or not same_shape(t.shape, shape) \
                or not same_shape(meta(u).shape, shape) or not meta(u).is_floating_point():
            return None
        cur = u
        if len(cur.users) != 1:
            return None
        (u,) = cur.users
    out = meta(u)
    if op_name(u) not in ("sum", "mean") or u.args != (cur,) or u.kwargs \
            or not isinstance(out, torch.Tensor) or out.dim() != 0 or out.dtype != meta(cur).dtype:
        return None
    reduce, chain, cur = u, [], u
    while len(cur.users) == 1:
        (u,) = cur.users
        name, out = op_name(u), meta(u)
        rule, _ = tail_rule(u, name)
        others = [a for a in u.all_input_nodes if a is not cur]
        if rule is None or rule.kind is Kind.REDUCE_ROWS or any(a in region for a in others):
            break
        args = _args(u)
        if not isinstance(out, torch.Tensor) or out.dim() != 0 or not out.is_floating_point() or u.kwargs \
                or cur not in args[:2] or args[:2].count(cur) != 1 or any(requires_grad(a) for a in others) \
                or not all(_per_group(a, ()) for a in others):
            return None
        if (rule.kind is Kind.SAME and out.dtype != meta(cur).dtype) or \
                (rule.kind is Kind.FACTOR and op_name(u) == "div" and args[0] is not cur):
            return None
        chain.append(u)
        cur = u
    return g, operand, reduce, chain


def _numel(item: Node) -> Any:
    """The number of elements of a split's item (symbolic where a size is)."""
    return math.prod(meta(item).shape)


def _fold(lasts: list[Node], order: dict[Node, int]) -> Optional[list[Node]]:
    """The adds that sum ``lasts`` one after another (``((0 + a) + b) + c``: Python's
    ``sum``, or written out), numbers beside them; the last add is the total.  None
    where the values meet otherwise."""
    left, fold, cur = set(lasts), [], min(lasts, key=order.__getitem__)
    left.discard(cur)
    while left:
        if len(cur.users) != 1:
            return None
        (u,) = cur.users
        if u.target not in (operator.add, torch.add) or u.kwargs or len(u.args) != 2 or cur not in u.args:
            return None
        (other,) = [a for a in u.args if a is not cur] or [cur]
        if other in left and len(other.users) == 1:  # (an item's value read elsewhere too: kept)
            left.discard(other)
        elif isinstance(other, Node):
            return None
        fold.append(u)
        cur = u
    while len(cur.users) == 1 and (u := next(iter(cur.users))).target in (operator.add, torch.add) \
            and not u.kwargs and len(u.args) == 2 and sum(a is cur for a in u.args) == 1 \
            and all(not isinstance(a, Node) for a in u.args if a is not cur):
        fold.append(u)  # (a number added after the last item)
        cur = u
    return fold if fold else None


def _rewrite_split(done: Regrouped, p: Node, x: Node, dim: int, sizes: list[int], items: list[tuple],
                   fold: list[Node], known: list[Node]) -> None:
    """The fold's total read as one sum over the rows of ``x`` times a mask and a factor a
    row: ``sum_i (a_i * sum(x_i * m_i) + d_i) = sum(x * m * cat(a_i)) + sum_i d_i`` (``m``
    the split mask itself where every ``m_i`` is its item, as the row-skipping reads it;
    a factor that is a number made with ``new_full`` of a tensor of ``known``)."""
    operands = [operand for _, operand, _, _ in items]
    if (any(o is None for o in operands) and not all(o is None for o in operands)) or not known:
        return
    total = fold[-1]
    emit = Emitter(done.graph, total)
    c_all, factors = _Coefficients(emit), []
    xt = meta(x)
    for (g, operand, reduce, chain), n in zip(items, sizes):
        c = _Coefficients(emit)
        if op_name(reduce) == "mean":
            c.a = 1.0 / _numel(g)  # (over every element of the item, its trailing dims too)
        cur = reduce
        for node in chain:
            c.step(node, cur)
            cur = node
        factors.append(c.a)
        c_all.d = c_all.op(operator.add, c_all.d, c.d)
    for u in fold:
        for a in u.args:
            if not isinstance(a, Node):
                c_all.d = c_all.op(operator.add, c_all.d, a)
    rows = c_all.op(operator.mul, x, _whole(emit, operands, p, dim, sizes))
    if any(isinstance(a, Node) or a != 1.0 for a in factors):
        def block(a: Any, n: int) -> Node:
            shape = (n, *xt.shape[1:])
            if isinstance(a, Node):
                return emit.method("expand", a, shape)
            return emit.method("new_full", known[0], shape, a, dtype=xt.dtype)
        scale = [block(a, n) for a, n in zip(factors, sizes)]
        scale = emit.function(torch.cat, scale, dim) if len(scale) > 1 else scale[0]
        rows = c_all.op(operator.mul, rows, scale)
    new = emit.method("sum", rows)
    if isinstance(c_all.d, Node) or c_all.d != 0.0:
        new = emit.function(operator.add, new, c_all.d)
    keep_meta(new, total)
    total.replace_all_uses_with(new)
    done.added += emit.added
    done.swaps.append((total, new))
    nodes = {p, *fold}
    for g, operand, reduce, chain in items:
        nodes |= {g, reduce, *chain, *(u for u in g.users if u is not reduce)}
    order = {n: i for i, n in enumerate(done.graph.nodes)}
    done.chains.append(sorted(nodes, key=order.__getitem__))


def _whole(emit: Emitter, operands: list, p: Node, dim: int, sizes: list[int]) -> Any:
    """The items' operands as one tensor of the rows: the tensor a split of the same sizes
    made them from, else their ``cat`` (1.0 where there are none)."""
    if operands[0] is None:
        return 1.0
    q = operands[0].args[0] if operands[0].target is operator.getitem else None
    if isinstance(q, Node) and op_name(q) == "split" and q.args[1:] == p.args[1:] and q.kwargs == p.kwargs \
            and all(o.target is operator.getitem and o.args == (q, i) for i, o in enumerate(operands)) \
            and len(q.users) == len(operands):
        return q.args[0]
    return emit.function(torch.cat, operands, dim)


def match_regrouped(graph: Graph, call: Node, match) -> tuple[Any, Optional[Regrouped]]:
    """``match(ignore)`` of the fused call ``call``'s loss tail; where it declines, again
    after :func:`regroup` (the rewrite then, or None): the caller undoes it where it
    declines later, or commits it.  :class:`~fx_passes.match.loss_tail.NoTail` (the graph
    unchanged) where neither matches."""
    from ..match.loss_tail import NoTail

    try:
        return match(frozenset()), None
    except NoTail:
        done = regroup(graph, call)
        if done is None:
            raise
    try:
        return match(frozenset(done.dead)), done
    except NoTail:
        done.undo()
        raise


def committed(regrouped: Optional[Regrouped]) -> None:
    """The user's per-sequence sums erased where the match took them (counted)."""
    if regrouped is not None:
        counters[COUNTER]["per_sequence_sums"] += len(regrouped.chains)
        regrouped.commit()
