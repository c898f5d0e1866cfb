"""The facts of a row-local body's nodes, per row, as nodes of a skip graph: the body run
once on a small example to read each node's shape, then each node read by its rule,
forward (:meth:`_BodyInterpreter.run_nodes`: exactly 0, an interval) and backward
(:func:`_body_backward`: a zero cotangent, a bound on it).  What the row-local skip
graphs (``match/body_mask.py``) and the vocab-parallel stages' (``distributed/shard_mask.py``)
are built from.  See NOTE [rows a row-local body leaves out] in ``match/body_mask.py``.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.fx import GraphModule, Node

from ..fx.graph_ops import op_name
from ..fx.op_rules import ZERO_ROWS, Kind, pointwise_op
from .masks import _column, no_rule
from .skip_graph import _Facts
from .tail_facts import Value, _Interpreter, _NoRule
from .vocab_rules import _VocabRules

__all__ = ["values_on", "BodyExample"]


_N = 13  # rows of the shape-reading example (``kernels/row_local/split._ROWS``: no other size shares it)
_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.neg}


def _shapes(body: GraphModule, rows: list, whole: list) -> dict[Node, Any]:
    """Each node's result on an example of ``_N`` rows (``(dtype, shape, device)`` specs)."""
    ex = [torch.zeros((_N, *s[1:]), dtype=d, device="cpu") for d, s, _ in rows]
    ex += [torch.zeros(s, dtype=d, device="cpu") for d, s, _ in whole]
    return values_on(body, ex)


def values_on(body: GraphModule, ex: list[torch.Tensor]) -> dict[Node, Any]:
    """Each node's result when ``body`` runs on ``ex`` (its placeholders in order)."""
    from torch.fx import Interpreter
    seen: dict[Node, Any] = {}

    class _Record(Interpreter):
        def run_node(self, n):
            seen[n] = out = super().run_node(n)
            return out
    with torch.no_grad():
        _Record(body).run(*ex)
    return seen


def _copyable(n: Node) -> bool:
    """May the skip graph run ``n`` itself (on every row)?  A pure op: a conversion, a
    view, or one ATen tags pointwise and not random; never an in-place one (it would
    change the row inputs), a random one (another draw than the body's), a module's."""
    name = op_name(n)
    return n.op in ("call_function", "call_method") and not name.endswith("_") \
        and (name in ZERO_ROWS or pointwise_op(name) or _column(n))


@dataclass(frozen=True)
class BodyExample:
    """A body as its rules read it: the module, each node's result on the shape-reading
    example of ``_N`` rows (:func:`values_on`), its logits' placeholder and the vocabulary's
    size on the example."""

    module: GraphModule
    values: dict[Node, Any]
    logits: Node
    vocab: int


class _BodyInterpreter(_VocabRules, _Interpreter):
    """The facts of a joined body's nodes (NOTE [rows a row-local body leaves out]): the
    body ``example``, the skip graph's ``f`` and its ``width`` placeholder, the row inputs
    that are ``masks``, the inputs whose facts the caller supplies (``inner_inputs``)."""

    def __init__(self, f: _Facts, example: BodyExample, width: Node, masks: set[Node],
                 inner_inputs: frozenset = frozenset()) -> None:
        body, values, logits = example.module, example.values, example.logits
        self.f, self.values, self.width = f, values, width
        self.env: dict[Node, Node] = {}
        self.facts: dict[Node, Value] = {}
        self.masks, self.logits, self.vocab = set(masks), logits, example.vocab
        self.shifted: dict[Node, str] = {}  # x - top: the kind of top (``_relational``)
        # inputs known by an interval only (the caller sets their facts), and those of them
        # no entry of a body value's row exceeds: ``{input: (kind, value)}`` (``_row_top``)
        self.tops: dict[Node, tuple[str, Node]] = {}
        self.unknown: list[str] = []  # the ops with no rule, said (NOTE [why every row runs])
        self.kind = {n: self._kind(v) for n, v in values.items()}
        # exact: computed from the inputs that are not the logits, one value a row or whole
        self.exact: set[Node] = set()
        self.inner: set[Node] = set()
        # numbers the rows do not change: the vocabulary's size (``width`` at run time: the
        # vocabulary may be dynamic) and arithmetic on it
        self.const: set[Node] = set()
        for n in body.graph.nodes:
            if n.op == "output":
                continue
            ins = n.all_input_nodes
            kind = self.kind.get(n)
            if self._constant(n):
                self.const.add(n)
                continue
            # (a value read whole is computed from values read whole only: never a sum over rows)
            if n is not logits and n not in inner_inputs and (n.op == "placeholder" or _copyable(n)) \
                    and kind in ("row", "whole") and all(a in self.exact for a in ins) \
                    and (kind == "row" or all(self.kind[a] == "whole" for a in ins)):
                self.exact.add(n)
                # (an integer row input may be a mask; a token id a gather reads, or a count
                # read whole, is not one: NOTE [why every row runs])
                integral = self._integral(n) and kind == "row" and not only_indices(n)
                if integral or (n.op != "placeholder" and ins and ins[0] in self.masks
                                and (ZERO_ROWS.get(op_name(n)) in (Kind.SAME, Kind.ROW_VIEW) or _column(n))):
                    self.masks.add(n)
            else:
                self.inner.add(n)

    def _constant(self, n: Node) -> bool:
        """``x.size(-1)`` of a wide value, or a number computed from such sizes only."""
        if isinstance(self.values.get(n), bool) or not isinstance(self.values.get(n), (int, float)):
            return False
        if n.op == "call_method" and n.target == "size" and len(n.args) == 2 and not n.kwargs:
            return self.kind.get(n.args[0]) == "wide" and n.args[1] in (1, -1)
        return n.op == "call_function" and n.target in _ARITHMETIC and not n.kwargs \
            and all(a in self.const for a in n.all_input_nodes)

    def _kind(self, v: Any) -> str:
        if not isinstance(v, torch.Tensor):
            return "other"
        s = tuple(v.shape)
        if s in ((_N,), (_N, 1)):
            return "row"
        if s == (_N, self.vocab):
            return "wide"
        return "other" if _N in s else "whole"

    def _integral(self, n: Node) -> bool:  # (a possible mask, NOTE [why every row runs])
        v = self.values.get(n)
        return isinstance(v, torch.Tensor) and not v.is_floating_point()

    def dtype(self, n: Node) -> Any:
        v = self.values.get(n)
        return v.dtype if isinstance(v, torch.Tensor) else None

    def value(self, a) -> Value:
        f = self.f
        if isinstance(a, Node) and a in self.inner:
            if a not in self.facts:
                raise _NoRule(f"{a.name} has no facts")
            return self.facts[a]
        if isinstance(a, Node) and a in self.const:
            x = self.env[a]  # (a 0-d FP64 tensor of the skip graph)
            return f.call(operator.eq, x, 0), x, x
        if isinstance(a, Node):
            x = self.env[a]
            if self.kind[a] == "row":
                x = f.g.call_method("reshape", (x, -1))
                exact = f.g.call_method("double", (x,))
                return (f.call(operator.eq, x, 0) if a in self.masks else False), exact, exact
            if self.values[a].dim() == 0:
                exact = f.g.call_method("double", (x,))
                return False, exact, exact
            lo = f.g.call_method("double", (f.g.call_method("amin", (x,)),))
            hi = f.g.call_method("double", (f.g.call_method("amax", (x,)),))
            return False, lo, hi
        if isinstance(a, (bool, int, float)):
            return a == 0, float(a), float(a)
        raise _NoRule(f"an operand {a!r}")

    def condition(self, c) -> Any:
        if isinstance(c, bool):
            return c
        if not isinstance(c, Node) or self.dtype(c) != torch.bool or c not in self.exact:
            raise _NoRule("a condition that is not a boolean computed from the row inputs one per row")
        x = self.env[c]
        return self.f.g.call_method("reshape", (x, -1)) if self.kind[c] == "row" else x

    def input_place(self, n: Node, x: Node) -> None:
        """The facts of a placeholder ``n`` that is inner (the logits: ``x`` is their bound
        ``z``; a wide input: ``x`` its value)."""
        g, f = self.f.g, self.f
        if n is self.logits:
            self.facts[n] = (False, f.minus(0.0, x), x)
            return
        if self.kind[n] != "wide":
            self.facts[n] = (False, -math.inf, math.inf)
            return
        lo = g.call_method("double", (g.call_method("amin", (x, -1)),))
        hi = g.call_method("double", (g.call_method("amax", (x, -1)),))
        self.facts[n] = (False, lo, hi)

    def node_forward(self, n: Node) -> Value:
        known = self.vocab_forward(n)
        if known is not None:
            return known
        f, out = self.f, self.kind.get(n)
        if out not in ("row", "wide"):
            raise _NoRule(f"{n.name}: a shape the rules do not read")
        self._divisor(n)
        hull = self._hull(n)
        if hull is not None:
            (vx, lx, ux), c = self.value(hull[0]), hull[1]
            return f.and_(vx, c == 0), f.low(lx, c), f.high(ux, c)
        return self._forward(n)

    def _hull(self, n: Node) -> Optional[tuple[Node, float]]:
        """``(x, c)`` for ``where(cond, x, c)`` / ``where(cond, c, x)`` (``c`` a number) whose
        boolean ``cond`` is not computed from the row inputs alone (a vocab-parallel stage's
        ``arange(V) == index``, its gather): the value is ``x`` or ``c``, in the hull of both,
        and passes ``x`` at most its own cotangent; else None (the exact rule reads ``cond``)."""
        if op_name(n) != "where" or n.kwargs or len(n.args) != 3:
            return None
        cond, a, b = n.args
        if not isinstance(cond, Node) or self.dtype(cond) != torch.bool or cond in self.exact:
            return None
        for x, c in ((a, b), (b, a)):
            if isinstance(x, Node) and isinstance(c, (int, float)) and not isinstance(c, bool):
                return x, float(c)
        return None

    def node_backward(self, n: Node, z: Any, m: Any) -> list[tuple[Any, Any, Any]]:
        hull = self._hull(n)
        if hull is not None:
            return [(hull[0], z, m)]
        known = self.vocab_backward(n, z, m)
        if known is not None:
            return known
        self._divisor(n)
        return self._backward(n, z, m)

    def _divisor(self, n: Node) -> None:
        """A ``div`` divides by one number a row (an exact per-row value or a scalar) or by
        a value of the body (its interval a row: ``match/tail_facts``'s rule), not by a tensor
        read whole."""
        if op_name(n) == "div" and len(n.args) > 1 and isinstance(n.args[1], Node):
            d = n.args[1]
            if d not in self.inner and self.kind.get(d) == "whole" and self.values[d].dim() > 0:
                raise _NoRule(f"{n.name}: a divisor that is not one number a row")

    def finite(self, a) -> Any:
        _, lo, hi = self.value(a) if not isinstance(a, tuple) else a
        return self.f.and_(self.f.finite(lo), self.f.finite(hi))

    def run_nodes(self, body: GraphModule) -> None:
        """The forward facts of ``body``'s nodes, in order (its placeholders' are set)."""
        f, g = self.f, self.f.g
        for n in body.graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            if n in self.const:  # the vocabulary's size, or arithmetic on such numbers
                self.env[n] = self.width if op_name(n) == "size" else g.node_copy(n, self.env.__getitem__)
                continue
            if n in self.exact:
                self.env[n] = g.node_copy(n, self.env.__getitem__)
                continue
            try:
                v, lo, hi = self.node_forward(n)
            except (_NoRule, KeyError) as e:
                if isinstance(e, _NoRule):
                    self.unknown.append(no_rule(n, e))
                v, lo, hi = False, -math.inf, math.inf
            self.facts[n] = (v, *f.capped(lo, hi, self.dtype(n)))


def _body_backward(run: _BodyInterpreter, body: GraphModule, seeds: list[tuple[Node, Any, Any]]) -> dict:
    """Per inner node of ``body``: "its cotangent is exactly 0" (``Zc``), from the
    cotangent facts ``seeds`` ``(result, Zc, Mc)`` of the body's results (none: 0)."""
    f = run.f
    Zc: dict[Node, Any] = {}
    Mc: dict[Node, Any] = {}

    def add(x, zero, m) -> None:
        if isinstance(x, Node) and x in run.inner:
            Zc[x] = f.and_(Zc.get(x, True), zero)
            Mc[x] = f.plus(Mc.get(x, 0.0), m)
    for x, zero, m in seeds:
        add(x, zero, m)
    for n in reversed(list(body.graph.nodes)):
        if n not in Zc or n.op == "placeholder":
            continue
        z, m = Zc[n], f.capped(f.minus(0.0, Mc[n]), Mc[n], run.dtype(n))[1]
        try:
            for a, za, ma in run.node_backward(n, z, m):
                add(a, za, ma)
        except (_NoRule, KeyError) as e:
            if isinstance(e, _NoRule):
                run.unknown.append(no_rule(n, e))
            for a in n.all_input_nodes:
                add(a, False, math.inf)
    return Zc


def only_indices(n: Node, depth: int = 4) -> bool:
    """Is ``n`` read only as the indices of a ``gather`` / ``take_along_dim``, through
    ``unsqueeze`` / ``view`` / ``long`` (a token's id picks a column: an integer tensor,
    but no mask)?"""
    if depth == 0 or not n.users:
        return False
    for u in n.users:
        if op_name(u) in ("gather", "take_along_dim") and u.args and u.args[0] is not n:
            continue
        if op_name(u) in ("unsqueeze", "view", "reshape", "long", "to") and only_indices(u, depth - 1):
            continue
        return False
    return True
