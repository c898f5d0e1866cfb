"""The skip graph's nodes: facts (a Python constant, or a node of the graph) combined with
constants folded, so a fact known at rewrite time adds no node.  :class:`_Facts` is what
the tail's rules (``match/tail_facts.py``), a row-local body's (``match/body_facts.py``)
and the vocab-parallel stages' (``distributed/shard_mask.py``) build their graphs with.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Union

import torch
from torch.fx import Graph, Node

__all__ = ["Fact"]


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
        ``dtype`` (any interval of a value that is not a float; ``[0, 1]`` of a boolean)."""
        if dtype is torch.bool:
            return 0.0, 1.0
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            return -math.inf, math.inf
        cap = torch.finfo(dtype).max / 2
        ok = self._op(operator.le, self.magnitude(lo, hi), cap)
        if isinstance(ok, bool):
            return (lo, hi) if ok else (-math.inf, math.inf)
        return self.select(ok, lo, -math.inf), self.select(ok, hi, math.inf)
