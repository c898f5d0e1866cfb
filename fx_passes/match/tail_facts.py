"""The facts of a loss tail's nodes, per row, as nodes of a skip graph: each op read by its
rule in :data:`fx_passes.fx.op_rules.ZERO_ROWS`, forward (exactly 0, an interval) and
backward (a zero cotangent, a bound on it).  See NOTE [rows a loss leaves out] in
``match/row_mask.py``, which builds the skip graph from these facts.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
from torch.fx import Node

from ..fx.graph_ops import canon, meta, op_name
from ..fx.op_rules import ZERO_ROWS, Kind
from .loss_tail import LossTail
from .masks import _mask_like, no_rule, why_every_row
from .skip_graph import Fact, _Facts

__all__ = ["Value", "say_why"]


class _NoRule(Exception):
    pass


def _args(node: Node) -> list:
    """The operands in the op's own order (``c / x`` for ``x.__rtruediv__(c)``)."""
    args = list(node.args)
    if node.op == "call_method" and str(node.target).startswith("__r") and op_name(node) != "rsub":
        args.reverse()
    return args


def _rule(node: Node) -> tuple[Kind, list]:
    """(the node's kind in ``ZERO_ROWS``, its operands) or :class:`_NoRule`."""
    name = "convert" if canon(node) == "convert" else op_name(node)
    rule = ZERO_ROWS.get(name)
    if rule is None:
        raise _NoRule(f"{name} has no rule")
    args = _args(node)
    if rule is Kind.CLAMP:
        args = [args[0], *([node.kwargs.get(k) for k in ("min", "max")] if node.kwargs else args[1:3])]
        args += [None] * (3 - len(args))
        if name == "clamp_min":
            args = [args[0], args[1], None]
        elif name == "clamp_max":
            args = [args[0], None, args[1]]
        return rule, args
    if rule not in (Kind.SAME, Kind.ROW_VIEW) and node.kwargs:
        raise _NoRule(f"{name} with keyword arguments")
    if rule is Kind.POWER:
        args = args + [2] if name == "square" else args
        k = args[1] if len(args) == 2 else None
        if not isinstance(args[0], Node) or isinstance(k, bool) or not isinstance(k, (int, float)) \
                or k != int(k) or not 1 <= k <= 8:
            raise _NoRule(f"{name}: not a tensor to a whole power from 1 to 8")
        return rule, [args[0], int(k)]
    if rule is Kind.EXTREMUM and (len(args) != 2 or not all(isinstance(a, Node) for a in args)):
        raise _NoRule(f"{name} of one tensor (a reduction)")
    if rule is Kind.COMPARE and len(args) != 2:
        raise _NoRule(f"{name} of {len(args)} operands")
    return rule, args


Value = tuple[Fact, Fact, Fact]  # (V: exactly 0, L, U: an interval holding the value)


class _Interpreter:
    """The facts of each tail node, as nodes of the skip graph (NOTE [rows a loss leaves out])."""

    derived: frozenset = frozenset()  # (a row-local body's interpreter reads none)

    def __init__(self, f: _Facts, tail: LossTail, env: dict[Node, Node]) -> None:
        self.f, self.tail, self.env = f, tail, env
        self.inner = set(tail.items) | set(tail.rows)
        # sums of the rows and what is computed from them, read back by rows (a sequence's
        # value read by its tokens: NOTE [values of several rows read back by a row])
        self.derived = set(tail.reductions) | set(tail.scalars)
        self.masks = _mask_like(tail)
        self.facts: dict[Node, Value] = {}
        self.unknown: list[str] = []  # the ops with no rule, said (NOTE [why every row runs])

    def value(self, a) -> Value:
        """The facts of an operand of a tail node (V: False for a factor that is not a mask)."""
        f = self.f
        if isinstance(a, Node) and a in self.inner:
            return self.facts[a]
        if isinstance(a, Node) and a in self.derived:
            return False, -math.inf, math.inf
        if isinstance(a, Node):
            x = self.env[a]
            exact = f.g.call_method("double", (x,))
            return (f.call(operator.eq, x, 0) if a in self.masks else False), exact, exact
        if isinstance(a, (bool, int, float)):
            return a == 0, float(a), float(a)
        raise _NoRule(f"an operand {a!r}")

    def finite(self, a) -> Fact:
        _, lo, hi = self.value(a) if not isinstance(a, tuple) else a
        return self.f.and_(self.f.finite(lo), self.f.finite(hi))

    def size(self, a) -> Fact:
        """A bound on ``|a|`` (inf or NaN when unknown)."""
        _, lo, hi = self.value(a)
        return self.f.magnitude(lo, hi)

    def _bound(self, b, none: float) -> tuple:
        """(low, high) ends of a clamp's bound ``b``: a number, or a tensor that does not
        depend on the region (its interval: a bound that does would take a gradient too);
        ``none`` where there is no bound."""
        if b is None:
            return none, none
        if self._inner(b):
            raise _NoRule("clamp by a value of the region")
        _, lo, hi = self.value(b)
        return lo, hi

    def _inner(self, a) -> bool:
        """Is ``a`` a value of the region (only an interval holds it)?"""
        return isinstance(a, Node) and (a in self.inner or a in self.derived)

    def _apart_from_0(self, lo: Fact, hi: Fact) -> Fact:
        """Does ``[lo, hi]`` leave 0 out (False where either end is NaN)?"""
        f = self.f
        return f.or_(f.positive(lo), f.positive(f.minus(0.0, hi)))

    def condition(self, c) -> Fact:
        """A ``where`` / ``masked_fill`` condition read from the tail's operands."""
        if isinstance(c, bool):
            return c
        if not isinstance(c, Node) or getattr(meta(c), "dtype", None) != torch.bool:
            raise _NoRule("a condition that is not a boolean tensor")
        if c in self.inner or c in self.derived:
            raise _NoRule("a condition that depends on the region")
        return self.env[c]

    def forward(self, bounds: list, leaving: list[Node] = (), items: Optional[list[Value]] = None) -> Fact:
        """Where every value the loss sums (and each per-row value ``leaving`` the graph)
        is exactly 0 (result ``i``'s interval ``bounds[2 i: 2 i + 2]``, or its facts
        ``items[i]``: a row-local body's, ``match/body_mask.skip_rows_of_region_reads``)."""
        for item, i in self.tail.items.items():
            self.facts[item] = items[i] if items is not None else (False, bounds[2 * i], bounds[2 * i + 1])
        for n in self.tail.rows:
            try:
                v, lo, hi = self._forward(n)
            except _NoRule as e:
                self.unknown.append(no_rule(n, e))
                v, lo, hi = False, -math.inf, math.inf
            self.facts[n] = (v, *self.f.capped(lo, hi, getattr(meta(n), "dtype", None)))
        skip: Fact = True
        for r in self.tail.reductions:
            skip = self.f.and_(skip, self.facts[r.all_input_nodes[0]][0])
        for n in leaving:
            skip = self.f.and_(skip, self.facts[n][0])
        return skip

    def _forward(self, n: Node) -> Value:
        f, (rule, args) = self.f, _rule(n)
        if rule is Kind.COMPARE:  # (False or True, whatever its operands hold: NaN compares False)
            return False, 0.0, 1.0
        several = [a for a in args if isinstance(a, Node) and a in self.derived]
        if several and rule is not Kind.SELECT:  # (NOTE [values of several rows read back by a row])
            self.unknown.append(f"{n.name} reads {several[0].name}, a value of several rows that no bound "
                                "holds")
            return False, -math.inf, math.inf
        if rule in (Kind.SAME, Kind.ROW_VIEW):
            return self.value(args[0])
        va, la, ua = self.value(args[0])
        if rule is Kind.NEGATE:
            return va, f.minus(0.0, ua), f.minus(0.0, la)
        if rule is Kind.EXP:
            return False, f.exp(la), f.exp(ua)
        if rule is Kind.LOG:  # (NaN or -inf where the interval reaches 0: not finite, capped)
            return False, f.log(la), f.log(ua)
        if rule is Kind.POWER:  # (x ** k: monotone for an odd k; in [0, |x| ** k] for an even one)
            k = args[1]
            if k % 2:
                return va, f.power(la, k), f.power(ua, k)
            return va, 0.0, f.power(self.size(args[0]), k)
        if rule is Kind.CLAMP:  # (nondecreasing in x and in each bound: the ends' images)
            lo, hi = (self._bound(b, -math.inf if i == 1 else math.inf) for i, b in enumerate(args[1:3], 1))
            return False, f.low(f.high(la, lo[0]), hi[0]), f.low(f.high(ua, lo[1]), hi[1])
        vb, lb, ub = self.value(args[1])
        if rule is Kind.EXTREMUM:
            pick = f.low if op_name(n) in ("min", "minimum", "fmin") else f.high
            return f.and_(va, vb), pick(la, lb), pick(ua, ub)
        if rule is Kind.SUM_OF_TERMS and op_name(n) == "add":
            return f.and_(va, vb), f.plus(la, lb), f.plus(ua, ub)
        if rule is Kind.SUM_OF_TERMS:  # a - b (rsub(a, b): b - a)
            (va, la, ua), (vb, lb, ub) = ((vb, lb, ub), (va, la, ua)) if op_name(n) == "rsub" else \
                ((va, la, ua), (vb, lb, ub))
            return f.and_(va, vb), f.minus(la, ub), f.minus(ua, lb)
        if rule is Kind.FACTOR and op_name(n) == "div" and self._inner(args[1]):
            apart = self._apart_from_0(lb, ub)  # (a divisor that depends on the region: an interval)
            ends = [f.over(a, b) for a in (la, ua) for b in (lb, ub)]
            zero = f.and_(va, f.and_(apart, self.finite(args[1])))
            return zero, f.select(apart, f.low(*ends), -math.inf), f.select(apart, f.high(*ends), math.inf)
        if rule is Kind.FACTOR and op_name(n) == "div":
            ends = (f.over(la, lb), f.over(ua, lb))  # (the divisor is one number a row: lb == ub)
            return f.and_(va, f.nonzero(self.size(args[1]))), f.low(*ends), f.high(*ends)
        if rule is Kind.FACTOR:
            ends = (f.times(la, lb), f.times(la, ub), f.times(ua, lb), f.times(ua, ub))
            zero = f.or_(f.and_(va, self.finite(args[1])), f.and_(vb, self.finite(args[0])))
            return zero, f.low(*ends), f.high(*ends)
        c, x, y = _select(n, args)  # (Kind.SELECT)
        cond = self.condition(c)
        (vx, lx, ux), (vy, ly, uy) = self.value(x), self.value(y)
        return (f.or_(f.and_(cond, vx), f.and_(f.not_(cond), vy)), f.select(cond, lx, ly),
                f.select(cond, ux, uy))

    def backward(self, weights: list, leaving: list[Node] = ()) -> Fact:
        """Where every result the tail reads gets an exactly-zero cotangent (``weights``:
        each sum's, a node or a number; a per-row value ``leaving`` the graph gets any)."""
        f, Zc, Mc = self.f, {}, {}

        def add(x, z: Fact, m: Fact) -> None:
            if isinstance(x, Node) and x in self.inner:
                Zc[x] = f.and_(Zc.get(x, True), z)
                Mc[x] = f.plus(Mc.get(x, 0.0), m)
        for r, w in zip(self.tail.reductions, weights):
            if isinstance(w, Node):
                add(r.all_input_nodes[0], f.call(operator.eq, w, 0), f.call(torch.abs, w))
            else:
                add(r.all_input_nodes[0], w == 0, abs(w))
        for n in leaving:
            add(n, False, math.inf)
        for n in reversed(self.tail.rows):
            if n in Zc:
                z, m = Zc[n], f.capped(f.minus(0.0, Mc[n]), Mc[n], getattr(meta(n), "dtype", None))[1]
                try:
                    for a, za, ma in self._backward(n, z, m):
                        add(a, za, ma)
                except _NoRule as e:
                    self.unknown.append(no_rule(n, e))
                    for a in n.all_input_nodes:
                        add(a, False, math.inf)
        # (each result's cotangent facts, for a row-local body's backward after these reads)
        self.cotangents = {item: (Zc.get(item, True), Mc.get(item, 0.0)) for item in self.tail.items}
        skip: Fact = True
        for item in self.tail.items:
            skip = f.and_(skip, Zc.get(item, True))
        for n in self.tail.rows:
            if any(a in self.derived for a in n.all_input_nodes):
                skip = f.and_(skip, self._passes_back_zero(n, Zc.get(n, True)))
        return skip

    def _passes_back_zero(self, n: Node, z: Fact) -> Fact:
        """Does row node ``n``, which reads a value of several rows, give it exactly 0 from
        this row (NOTE [values of several rows read back by a row]: that value's gradient
        then stays stock's on every other row): its own cotangent exactly 0 (``z``) and
        its derivative in that value finite (the other factor of a product; a sum, a
        selection, a comparison: at most 1)."""
        try:
            rule, args = _rule(n)
        except _NoRule:
            return False
        if rule is Kind.COMPARE:
            return True
        if rule in (Kind.SAME, Kind.ROW_VIEW, Kind.NEGATE, Kind.SUM_OF_TERMS, Kind.SELECT, Kind.EXTREMUM):
            return z
        if rule is Kind.FACTOR and op_name(n) == "mul" and len(args) == 2:
            (a, b), several = args, [isinstance(x, Node) and x in self.derived for x in args]
            if all(several):
                return False
            return self.f.and_(z, self.finite(b if several[0] else a))
        return False

    def _backward(self, n: Node, z: Fact, m: Fact) -> list[tuple[Any, Fact, Fact]]:
        """(operand, Zc, Mc) of the cotangent ``n`` passes to each operand (a zero
        cotangent stays zero through a bounded derivative)."""
        f, (rule, args) = self.f, _rule(n)
        if rule in (Kind.SAME, Kind.ROW_VIEW, Kind.NEGATE):
            return [(args[0], True, 0.0) if op_name(n) == "detach" else (args[0], z, m)]
        if rule is Kind.COMPARE:  # (a boolean: no gradient reaches its operands)
            return []
        if rule in (Kind.CLAMP, Kind.EXTREMUM):  # (a derivative of 0, 1 or 1/2 per operand)
            return [(a, z, m) for a in (args[:1] if rule is Kind.CLAMP else args)]
        if rule is Kind.EXP:  # c * exp(x)
            top = self.facts[n][2]
            return [(args[0], f.and_(z, f.finite(top)), f.times(m, top))]
        if rule is Kind.POWER:  # c * k * x ** (k - 1)
            slope = f.times(float(args[1]), f.power(self.size(args[0]), args[1] - 1))
            return [(args[0], f.and_(z, f.finite(slope)), f.times(m, slope))]
        if rule is Kind.SUM_OF_TERMS:
            return [(args[0], z, m), (args[1], z, m)]
        if rule is Kind.LOG:  # c / x: bounded where x's interval is above 0
            _, la, _ = self.value(args[0])
            slope = f.select(f.positive(la), f.over(1.0, la), math.inf)
            return [(args[0], f.and_(z, f.finite(slope)), f.times(m, slope))]
        if rule is Kind.FACTOR and op_name(n) == "div" and self._inner(args[1]):
            # c * (1 / y, -x / y ** 2): bounded where y's interval stays away from 0
            _, lb, ub = self.value(args[1])
            apart = self._apart_from_0(lb, ub)
            least = f.select(apart, f.low(f._op(torch.abs, lb), f._op(torch.abs, ub)), 0.0)
            sx = f.over(1.0, least)  # (inf where the interval holds 0)
            sy = f.times(self.size(args[0]), f.times(sx, sx))
            return [(args[0], f.and_(z, f.finite(sx)), f.times(m, sx)),
                    (args[1], f.and_(z, f.finite(sy)), f.times(m, sy))]
        if rule is Kind.FACTOR and op_name(n) == "div":
            size = self.size(args[1])
            return [(args[0], f.and_(z, f.nonzero(size)), f.over(m, size))]
        if rule is Kind.FACTOR:
            va, vb = self.value(args[0])[0], self.value(args[1])[0]
            sa, sb = self.size(args[0]), self.size(args[1])
            return [(args[0], f.or_(f.and_(z, f.finite(sb)), f.and_(vb, f.finite(m))), f.times(m, sb)),
                    (args[1], f.or_(f.and_(z, f.finite(sa)), f.and_(va, f.finite(m))), f.times(m, sa))]
        c, x, y = _select(n, args)  # (Kind.SELECT)
        cond = self.condition(c)
        return [(x, f.or_(f.not_(cond), z), f.select(cond, m, 0.0)),
                (y, f.or_(cond, z), f.select(cond, 0.0, m))]


def _select(n: Node, args: list) -> tuple:
    """(condition, value where true, value where false) of a ``where`` / ``masked_fill``."""
    return (args[0], args[1], args[2]) if op_name(n) == "where" else (args[1], args[2], args[0])


def say_why(run: "_Interpreter", leaving: list[Node], why: Optional[list[str]],
            unknown: list[str] = (), masked: bool = False) -> None:
    """Append to ``why`` the reason the reads of ``run`` skip no row (NOTE [why every row
    runs]; ``unknown``, ``masked``: ops with no rule met before them and whether a mask
    was, a row-local body's)."""
    unmasked = [f"{r.name} reads {r.all_input_nodes[0].name} on every row, unmasked"
                for r in run.tail.reductions if run.facts[r.all_input_nodes[0]][0] is False]
    unmasked += [f"the graph returns {n.name} for every row" for n in leaving if run.facts[n][0] is False]
    reason = why_every_row(masked or bool(run.masks), [*unknown, *run.unknown], unmasked)
    if reason is not None and why is not None:
        why.append(reason)
