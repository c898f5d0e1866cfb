"""The facts of a loss tail's nodes, per row, as nodes of a skip graph: each op read by its
rule in :data:`fx_passes.fx.op_rules.ZERO_ROWS`, forward (exactly 0, an interval) and
backward (a zero cotangent, a bound on it).  See NOTE [rows a loss leaves out] in
``match/row_mask.py``, which builds the skip graph from these facts.
"""

# NOTE [the same value in both programs]
# Where the reads sum rows over some dims and read the sums back (NOTE [values of several
# rows read back by a row] in ``match/loss_tail.py``), a row left out need not read 0: it
# must read what stock's program reads.  On a row left out the rewritten program computes
# the reads from the results' stand-ins (values of their intervals), stock's from the true
# results; every other input (an operand, a value of several rows, once every sum agrees)
# is the same in both.  So besides ``V`` each row node has ``S``: its value is the same in
# both programs (exactly 0 where ``V``; a pure op of same values; ``x - x.detach()``, the
# straight-through spelling, is exactly 0 where ``x`` is finite).  A sum's term or a
# returned value may be ``V`` or ``S``: verl's GSPO, ``exp(clamp(lp - lp.detach() +
# seq.detach(), max=10))`` times the advantage and the mask, is ``S`` on a masked row
# whatever the sequence's value, NaN included.  Backward, ``Zn``: the cotangent is exactly 0
# in both programs, or not finite in both (the masked op's backward turns a left-out row's
# cotangent that is not 0 into stock's NaN gradients).  A zero cotangent times a derivative
# finite in both, or the same in both (``exp`` of an ``S`` value), is 0 or NaN in both; a
# choice (a clamp, a ``max``) must be made on ``S`` values to pass one that is not finite.
# Only tails that read such values use ``S`` and ``Zn``; elsewhere ``S`` is ``V`` and ``Zn``
# is ``Zc`` (exactly 0), as before.

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
    reads_back = False

    def __init__(self, f: _Facts, tail: LossTail, env: dict[Node, Node]) -> None:
        self.f, self.tail, self.env = f, tail, env
        self.inner = set(tail.items) | set(tail.rows)
        # sums of the rows and what is computed from them, read back by rows (a sequence's
        # value read by its tokens: NOTE [values of several rows read back by a row])
        self.derived = set(tail.reductions) | set(tail.scalars)
        # (only reads kept in the graph, whose masked op turns a left-out row's cotangent that
        # is not 0 into stock's NaNs, have rows reading such values: NOTE [the same value in
        # both programs]; a loss loop's sums must get exactly 0 from a row left out)
        self.reads_back = any(a in self.derived for n in tail.rows for a in n.all_input_nodes)
        self.masks = _mask_like(tail)
        self.facts: dict[Node, Value] = {}
        self.same: dict[Node, Fact] = {}  # NOTE [the same value in both programs]
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
            self.same[item] = False
        for n in self.tail.rows:
            try:
                v, lo, hi = self._forward(n)
            except _NoRule as e:
                self.unknown.append(no_rule(n, e))
                v, lo, hi = False, -math.inf, math.inf
            self.facts[n] = (v, *self.f.capped(lo, hi, getattr(meta(n), "dtype", None)))
            same: Fact = True  # (a pure op on the same values: NOTE [the same value in both programs])
            for a in n.all_input_nodes:
                same = self.f.and_(same, self.is_same(a))
            self.same[n] = self.f.or_(v, same)
        skip: Fact = True
        for r in self.tail.reductions:
            skip = self.f.and_(skip, self._read_as_stock(r.all_input_nodes[0]))
        for n in leaving:
            skip = self.f.and_(skip, self._read_as_stock(n))
        return skip

    def is_same(self, a) -> Fact:
        """Is ``a`` the same value in stock's program and in the rewritten one, on a row left
        out (NOTE [the same value in both programs])?  A number, an operand or a value of
        several rows is; a result is not."""
        return self.same.get(a, False) if isinstance(a, Node) and a in self.inner else True

    def _read_as_stock(self, n: Node) -> Fact:
        """A summed or returned row value is stock's: exactly 0, or (reads of values of
        several rows only) the same value in both programs."""
        return self.f.or_(self.facts[n][0], self.same[n]) if self.reads_back else self.facts[n][0]

    def _forward(self, n: Node) -> Value:
        f, (rule, args) = self.f, _rule(n)
        if rule is Kind.COMPARE:  # (False or True, whatever its operands hold: NaN compares False)
            return False, 0.0, 1.0
        if _straight_through(n, rule, args):  # (x - x.detach(): exactly 0 where x is finite)
            fin = self.finite(args[0])
            return fin, f.select(fin, 0.0, -math.inf), f.select(fin, 0.0, math.inf)
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
        f, Zc, Mc, Zn = self.f, {}, {}, {}  # (Zn: NOTE [the same value in both programs])

        def add(x, z: Fact, m: Fact, zn: Fact) -> None:
            if isinstance(x, Node) and x in self.inner:
                Zc[x] = f.and_(Zc.get(x, True), z)
                Mc[x] = f.plus(Mc.get(x, 0.0), m)
                Zn[x] = f.and_(Zn.get(x, True), f.or_(z, zn))
        for r, w in zip(self.tail.reductions, weights):
            if isinstance(w, Node):
                add(r.all_input_nodes[0], f.call(operator.eq, w, 0), f.call(torch.abs, w), False)
            else:
                add(r.all_input_nodes[0], w == 0, abs(w), False)
        for n in leaving:
            add(n, False, math.inf, False)
        for n in reversed(self.tail.rows):
            if n in Zc:
                z, m = Zc[n], f.capped(f.minus(0.0, Mc[n]), Mc[n], getattr(meta(n), "dtype", None))[1]
                try:
                    for a, za, ma in self._backward(n, z, m):
                        add(a, za, ma, f.and_(Zn[n], self._same_slope(n, a)) if self.reads_back else False)
                except _NoRule as e:
                    self.unknown.append(no_rule(n, e))
                    for a in n.all_input_nodes:
                        add(a, False, math.inf, False)
        # (each result's cotangent facts, for a row-local body's backward after these reads)
        self.cotangents = {item: (Zc.get(item, True), Mc.get(item, 0.0)) for item in self.tail.items}
        skip: Fact = True
        for item in self.tail.items:
            skip = f.and_(skip, Zn.get(item, True))
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
        if not any(_may_need_grad(a) for a in n.all_input_nodes if a in self.derived):
            return True  # (a detached value: nothing flows back to it)
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

    def _same_slope(self, n: Node, a: Node) -> Fact:
        """Does ``n``'s backward pass ``a`` its cotangent times a derivative that is finite
        in both programs or the same in both, and choose (a clamp, a ``max``) the same way in
        both (NOTE [the same value in both programs])?  Then a cotangent exactly 0 in both,
        or not finite in both, stays so."""
        f, (rule, args) = self.f, _rule(n)
        if rule in (Kind.SAME, Kind.ROW_VIEW, Kind.NEGATE, Kind.SUM_OF_TERMS, Kind.SELECT):
            return True  # (a derivative of 1 or -1; a selection by a condition the region does not change)
        if rule in (Kind.EXP, Kind.LOG, Kind.POWER, Kind.CLAMP):  # (of its one tensor operand)
            return self.is_same(args[0])
        if rule is Kind.EXTREMUM:
            return f.and_(self.is_same(args[0]), self.is_same(args[1]))
        if rule is Kind.FACTOR and op_name(n) == "mul":
            if args[0] is args[1]:  # (x * x: 2 x)
                return self.is_same(a)
            other = args[1] if args[0] is a else args[0]
            return f.or_(self.finite(other), self.is_same(other))
        if rule is Kind.FACTOR:  # (x / y: 1 / y and -x / y ** 2)
            return f.and_(self.is_same(args[0]), self.is_same(args[1]))
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


def _may_need_grad(a: Node) -> bool:
    """Does ``a`` need a gradient, or is its example value unknown?"""
    v = meta(a)
    return not isinstance(v, torch.Tensor) or v.requires_grad


def _straight_through(n: Node, rule: Kind, args: list) -> bool:
    """``x - x.detach()`` (the straight-through spelling): 0 in the forward."""
    d = args[1] if rule is Kind.SUM_OF_TERMS and op_name(n) == "sub" and len(args) == 2 else None
    x = args[0] if isinstance(args[0], Node) else None
    return x is not None and isinstance(d, Node) and op_name(d) == "detach" and d.args[:1] == (x,)


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
