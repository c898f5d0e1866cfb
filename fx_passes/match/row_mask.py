"""Rows a loss tail leaves out: which rows' values and gradients are exactly zero, per step.

:func:`skip_rows_body` reads a matched :class:`~fx_passes.match.loss_tail.LossTail` and
builds an FX graph ``skip(*item_bounds, *row_operands, *whole, *weights) -> bool [rows]``:
True where the row adds exactly 0 to every sum the loss reads *and* its results get an
exactly-zero gradient, so the chunk loops may leave it out (``kernels/rows.py``).  Its
inputs are per-row intervals holding the results (``rows.item_bounds``), the tail's
operands and each reduction's ``d loss / d row value``.  None: no row can ever be
skipped (the region runs every row, as before).  The rules are :data:`fx_passes.fx.op_rules.ZERO_ROWS`; see
NOTE [rows a loss leaves out].
"""

# NOTE [rows a loss leaves out]
# A row may be left out of the chunk loop only when stock's answer for it is exactly what
# leaving it out gives: 0 added to each sum, 0 added to every gradient.  Stock's gradient
# of a row whose cotangent is 0 is ``0 * exp(logp)``, NaN when the row's logits are not
# finite, and a zero that crosses ``x * y`` on the way is ``0 * y``, NaN when ``y`` is not.
# So the graph built here evaluates, per row and at run time, an abstract interpretation
# of the tail's ops with two facts per node:
#
# * forward, from the results to the sums: ``V`` (the value is exactly 0) and an interval
#   ``[L, U]`` holding it (infinite or NaN when unknown; the results' own intervals come
#   from the logits' bound, ``kernels/rows.logit_bounds``);
# * backward, from the sums to the results: ``Zc`` (the cotangent is exactly 0) and
#   ``Mc`` (a bound on it), starting from each reduction's weight.
#
# ``where(m, x, 0)`` and ``masked_fill`` select, so they zero a value and a cotangent
# whatever the other side holds; ``x * y`` is zero only where one side is zero and the
# other finite; ``x / y`` passes a zero where ``y`` is a nonzero number; ``x ** k`` is 0
# where ``x`` is; ``exp``, ``x ** k``, ``clamp``, ``min`` / ``max`` pass a zero cotangent
# where their derivative is bounded (the interval).  A factor counts as a zero only when
# it is a mask (boolean or integer, or summed whole as a masked mean's denominator): an
# advantage may be 0 on some rows, but a region whose only zeros are such factors would
# pay a host read every step for little (``_mask_like``).  A row is skipped where every
# summed value has ``V`` and every result read has ``Zc``, and the logits' bound is
# finite (then log-softmax's backward of a 0 cotangent is exactly 0, as stock's).
# An op with no rule gives ``V = Zc = False``: its rows are computed, never guessed.

from __future__ import annotations

import math
import operator
from typing import Any, Optional, Union

import torch
from torch.fx import Graph, GraphModule, Node

from ..fx.graph_ops import canon, is_collective, meta, op_name
from ..fx.op_rules import ZERO_ROWS, Kind
from ..kernels.ops import user_bodies
from .loss_tail import LossTail

__all__ = ["skip_rows_body", "skip_rows_of_reads", "masks_among", "mask_read", "no_rule", "why_every_row",
           "say_why", "ITEMS"]

ITEMS = ("lse_lo", "lse_hi", "lp_lo", "lp_hi", "ent_lo", "ent_hi")
Fact = Union[bool, float, Node]  # a Python constant, or a node of the skip graph


class _Facts:
    """Nodes of the skip graph, with constants folded."""

    def __init__(self, g: Graph) -> None:
        self.g = g

    def call(self, fn, *args) -> Node:
        return self.g.call_function(fn, args)

    def _logic(self, a: Fact, b: Fact, absorbing: bool, fn) -> Fact:
        """``fn(a, b)`` with ``absorbing`` (False for and, True for or) folded."""
        if a is absorbing or b is absorbing:
            return absorbing
        if a is (not absorbing):
            return b
        return a if b is (not absorbing) else self.call(fn, a, b)

    def and_(self, a: Fact, b: Fact) -> Fact:
        return self._logic(a, b, False, torch.logical_and)

    def or_(self, a: Fact, b: Fact) -> Fact:
        return self._logic(a, b, True, torch.logical_or)

    def not_(self, a: Fact) -> Fact:
        return (not a) if isinstance(a, bool) else self.call(torch.logical_not, a)

    def finite(self, m: Fact) -> Fact:
        return math.isfinite(m) if isinstance(m, (int, float)) else self.call(torch.isfinite, m)

    def positive(self, a: Fact) -> Fact:
        """``a > 0`` (False for NaN)."""
        return (a > 0) if isinstance(a, (int, float)) else self.call(operator.gt, a, 0)

    def nonzero(self, m: Fact) -> Fact:
        """``m > 0`` (False for NaN): a magnitude that is not 0."""
        return (m > 0) if isinstance(m, (int, float)) else self.call(operator.gt, m, 0)

    def _op(self, fn, *args) -> Fact:
        """``fn(*args)``: folded in FP64 when every argument is a number, else a node."""
        if all(isinstance(a, (int, float)) for a in args):
            return fn(*(torch.tensor(float(a), dtype=torch.float64) for a in args)).item()
        return self.call(fn, *args)

    def times(self, a: Fact, b: Fact) -> Fact:
        return self._op(operator.mul, a, b)  # (inf * 0 is NaN: not finite)

    def plus(self, a: Fact, b: Fact) -> Fact:
        return self._op(operator.add, a, b)

    def minus(self, a: Fact, b: Fact) -> Fact:
        return self._op(operator.sub, a, b)

    def over(self, a: Fact, b: Fact) -> Fact:
        return self._op(operator.truediv, a, b)

    def _pick(self, a: Fact, b: Fact, smaller: bool) -> Fact:
        """The smaller (larger) of two bounds, NaN if either is (an unknown bound stays unknown)."""
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return self._op(torch.minimum if smaller else torch.maximum, a, b)
        if isinstance(a, (int, float)):
            a, b = b, a
        if isinstance(b, (int, float)):
            return self.g.call_function(torch.clamp, (a,), {"max" if smaller else "min": b})
        return self.call(torch.minimum if smaller else torch.maximum, a, b)

    def low(self, *xs: Fact) -> Fact:
        out = xs[0]
        for x in xs[1:]:
            out = self._pick(out, x, True)
        return out

    def high(self, *xs: Fact) -> Fact:
        out = xs[0]
        for x in xs[1:]:
            out = self._pick(out, x, False)
        return out

    def exp(self, a: Fact) -> Fact:
        return self._op(torch.exp, a)

    def log(self, a: Fact) -> Fact:
        return self._op(torch.log, a)

    def xlogy(self, a: Fact) -> Fact:
        """``a * log(a)`` (0 at 0; NaN below)."""
        return self._op(torch.xlogy, a, a)

    def power(self, a: Fact, k: int) -> Fact:
        """``a ** k`` (``k`` a whole number; 1 for ``k == 0``, as the derivative of ``x ** 1``)."""
        if k == 0:
            return 1.0
        if isinstance(a, (int, float)):
            return self._op(torch.pow, a, float(k))
        return self.call(torch.pow, a, k)

    def magnitude(self, lo: Fact, hi: Fact) -> Fact:
        return self.high(self._op(torch.abs, lo), self._op(torch.abs, hi))

    def select(self, c: Fact, a: Fact, b: Fact) -> Fact:
        if isinstance(c, bool):
            return a if c else b
        return self.call(torch.where, c, a, b)

    def capped(self, lo: Fact, hi: Fact, dtype: Any) -> tuple[Fact, Fact]:
        """``[lo, hi]``, or ``[-inf, inf]`` where a value that large might round to inf in
        ``dtype`` (any interval of a value that is not a float)."""
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            return -math.inf, math.inf
        cap = torch.finfo(dtype).max / 2
        ok = self._op(operator.le, self.magnitude(lo, hi), cap)
        if isinstance(ok, bool):
            return (lo, hi) if ok else (-math.inf, math.inf)
        return self.select(ok, lo, -math.inf), self.select(ok, hi, math.inf)


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
        if any(isinstance(a, Node) for a in args[1:]):
            raise _NoRule(f"{name} by a tensor")
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
    return rule, args


def skip_rows_body(tail: LossTail, why: Optional[list[str]] = None) -> Optional[str]:
    """The registered key of the tail's skip graph, or None when no row can be skipped
    whatever the inputs hold (a result read unmasked, an op with no rule on every path;
    where the tail has a mask, the reason is appended to ``why``: NOTE [why every row
    runs])."""
    g = Graph()
    bounds = [g.placeholder(name) for name in ITEMS]
    env: dict[Node, Node] = {o: g.placeholder(f"row{i}") for i, o in enumerate(tail.row_operands)}
    env.update({o: g.placeholder(f"whole{i}") for i, o in enumerate(tail.whole)})
    weights = [g.placeholder(f"weight{k}") for k in range(len(tail.reductions))]
    skip = _skip(_Interpreter(_Facts(g), tail, env), bounds, weights, why=why)
    return None if skip is None else user_bodies.register(GraphModule(torch.nn.Module(), g))


def skip_rows_of_reads(tail: LossTail, why: Optional[list[str]] = None) -> Optional[tuple[str, list[Node]]]:
    """The skip graph of the per-token results' readers (``match.loss_tail.match_reads``):
    ``skip(*item_bounds, *operands) -> bool [rows]``, True where every value read (each sum,
    each per-row value leaving the graph) is exactly 0 whatever the results hold in their
    intervals and no result gets a gradient but an exact 0 or, through ``0 * inf``, NaN
    (each sum's incoming gradient is unknown here: taken as a finite number; the op's
    backward turns a skipped row's NaN cotangent into stock's NaN gradients).  Returns its
    key and the tail's operands it reads, in order; None when no row can be skipped (the
    reason appended to ``why`` where the reads have a mask)."""
    g = Graph()
    bounds = [g.placeholder(name) for name in ITEMS]
    operands = [*tail.row_operands, *tail.whole]
    env: dict[Node, Node] = {o: g.placeholder(f"operand{i}") for i, o in enumerate(operands)}
    run = _Interpreter(_Facts(g), tail, env)
    skip = _skip(run, bounds, [1.0] * len(tail.reductions), [n for n in tail.leaving if n in run.inner], why)
    if skip is None:
        return None
    read = [o for o in operands if env[o].users]
    for o in operands:
        if not env[o].users:
            g.erase_node(env[o])
    return user_bodies.register(GraphModule(torch.nn.Module(), g)), read


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


def _skip(run: "_Interpreter", bounds: list[Node], weights: list, leaving: list[Node] = (),
          why: Optional[list[str]] = None) -> Optional[Node]:
    """The skip graph's output (set on ``run``'s graph), or None when it is False (the
    reason appended to ``why``, where the tail has a mask)."""
    skip = run.forward(bounds, leaving)
    if skip is not False:
        skip = run.f.and_(skip, run.backward(weights, leaving))
    if skip is False:
        say_why(run, leaving, why)
        return None
    return run.f.g.output(run.f.and_(skip, run.f.finite(bounds[1])))


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


Value = tuple[Fact, Fact, Fact]  # (V: exactly 0, L, U: an interval holding the value)


class _Interpreter:
    """The facts of each tail node, as nodes of the skip graph (NOTE [rows a loss leaves out])."""

    def __init__(self, f: _Facts, tail: LossTail, env: dict[Node, Node]) -> None:
        self.f, self.tail, self.env = f, tail, env
        self.inner = set(tail.items) | set(tail.rows)
        self.masks = _mask_like(tail)
        self.facts: dict[Node, Value] = {}
        self.unknown: list[str] = []  # the ops with no rule, said (NOTE [why every row runs])

    def value(self, a) -> Value:
        """The facts of an operand of a tail node (V: False for a factor that is not a mask)."""
        f = self.f
        if isinstance(a, Node) and a in self.inner:
            return self.facts[a]
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

    def _inner(self, a) -> bool:
        """Is ``a`` a value of the region (only an interval holds it)?"""
        return isinstance(a, Node) and a in self.inner

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
        if c in self.inner:
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
        if rule is Kind.CLAMP:
            lo = args[1] if args[1] is not None else -math.inf
            hi = args[2] if args[2] is not None else math.inf
            return False, f.low(f.high(la, lo), hi), f.low(f.high(ua, lo), hi)
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
        return skip

    def _backward(self, n: Node, z: Fact, m: Fact) -> list[tuple[Any, Fact, Fact]]:
        """(operand, Zc, Mc) of the cotangent ``n`` passes to each operand (a zero
        cotangent stays zero through a bounded derivative)."""
        f, (rule, args) = self.f, _rule(n)
        if rule in (Kind.SAME, Kind.ROW_VIEW, Kind.NEGATE):
            return [(args[0], True, 0.0) if op_name(n) == "detach" else (args[0], z, m)]
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
