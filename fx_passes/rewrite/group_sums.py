"""Sums per sequence in a loss tail, made one sum over the rows (NOTE [per-sequence sums]).

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

from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
from torch.fx import Graph, Node

from ..fx.emitter import Emitter
from ..fx.graph_ops import keep_meta, meta, op_name, requires_grad, same, same_shape
from ..fx.op_rules import Kind, tail_rule

__all__ = ["Regrouped", "regroup"]

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
        found = _chain(p, region)
        if found is not None and p not in done.dead:
            _rewrite(done, *found, known)
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
