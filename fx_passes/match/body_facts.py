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
from ..fx.op_rules import FLOATS, ZERO_ROWS, Kind, pointwise_op
from .masks import _column, no_rule
from .row_local import LOSS_PARAMS, loss_arg
from .skip_graph import _Facts
from .tail_facts import Value, _Interpreter, _NoRule

__all__ = ["values_on"]


_N = 13  # rows of the shape-reading example (``kernels/row_local/split._ROWS``: no other size shares it)
_REDUCE = {"sum", "mean", "amax", "amin", "logsumexp"}
_NORMALIZE = {"log_softmax", "softmax"}
_KWARGS = {"dim", "keepdim", "dtype", "_stacklevel"}
_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.neg}


@dataclass(frozen=True)
class _Loss:
    """A ``cross_entropy`` / ``nll_loss`` with ``reduction='none'``: its input ``x``, the rows
    ``ignored`` (``ignore_index``), its ``smoothing``, and its class ``weight`` (None, or an
    input read whole: ``w_zero`` where the row's class weighs 0, ``[w_lo, w_hi]`` its range)."""

    x: Node
    ignored: Any
    smoothing: float
    weight: Optional[Node]
    w_zero: Any
    w_lo: Any
    w_hi: Any


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



class _BodyInterpreter(_Interpreter):
    """The facts of a joined body's nodes (NOTE [rows a row-local body leaves out])."""

    def __init__(self, f: _Facts, body: GraphModule, values: dict[Node, Any], logits: Node, vocab: int,
                 width: Node, masks: set[Node], inner_inputs: frozenset = frozenset()) -> None:
        self.f, self.values, self.width = f, values, width
        self.env: dict[Node, Node] = {}
        self.facts: dict[Node, Value] = {}
        self.masks, self.logits, self.vocab = set(masks), logits, vocab
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
                if self._integral(n) or (n.op != "placeholder" and ins and ins[0] in self.masks
                                         and (ZERO_ROWS.get(op_name(n)) in (Kind.SAME, Kind.ROW_VIEW)
                                              or _column(n))):
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

    def _integral(self, n: Node) -> bool:
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

    def _wide(self, n: Node) -> Node:
        """The operand a reduction over the vocabulary reads, checked."""
        x = n.args[0] if n.args else n.kwargs.get("input")
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        if isinstance(dim, (list, tuple)) and len(dim) == 1:
            dim = dim[0]
        if not isinstance(x, Node) or self.kind.get(x) != "wide" or dim not in (-1, 1) or len(n.args) > 3:
            raise _NoRule(f"{n.name}: not a reduction over the vocabulary")
        if set(n.kwargs) - _KWARGS - {"input"} or n.kwargs.get("dtype") not in (None, *FLOATS):
            raise _NoRule(f"{n.name}: keyword arguments the rule does not read")
        return x

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
        f, name = self.f, op_name(n)
        out = self.kind.get(n)
        related = self._relational(n)
        if related is not None:
            return related
        if name in _REDUCE or name in _NORMALIZE:
            x_ = self._wide(n)
            _, lo, hi = self.value(x_)
            if (name in _REDUCE) != (out == "row") or (name in _NORMALIZE and out != "wide"):
                raise _NoRule(f"{n.name}: not a reduction over the vocabulary")
            log_w = f.call(torch.log, self.width)
            if name == "sum":
                return self.value(n.args[0])[0], f.times(lo, self.width), f.times(hi, self.width)
            if name in ("mean", "amax", "amin"):
                return self.value(n.args[0])[0], lo, hi
            if name == "logsumexp":
                return False, lo, f.plus(hi, log_w)
            if name == "log_softmax":
                return False, f.minus(lo, f.plus(hi, log_w)), 0.0
            return False, f.select(self.finite(x_), 0.0, -math.inf), 1.0  # softmax: in [0, 1] if finite
        if _column(n) and self.kind.get(n.args[0]) == "row" and out == "row":
            return self.value(n.args[0])
        if name == "gather":
            x, dim = n.args[0], n.args[1] if len(n.args) > 1 else None
            if self.kind.get(x) != "wide" or dim not in (-1, 1) or out != "row" or n.kwargs:
                raise _NoRule(f"{n.name}: not a gather of one column a row")
            return self.value(x)
        if name == "kl_div":  # exp(t) * (t - x) (log_target), else xlogy(t, t) - t * x
            x, t, log_target = self._kl_div(n)
            (_, xl, xh), (_, tl, th) = self.value(x), self.value(t)
            if log_target:
                gaps = (f.minus(tl, xh), f.minus(th, xl))
                ends = [f.times(a, b) for a in (f.exp(tl), f.exp(th)) for b in gaps]
                return False, f.low(*ends), f.high(*ends)
            ends = [f.times(a, b) for a in (tl, th) for b in (xl, xh)]
            top = f.high(f.xlogy(tl), f.xlogy(th))  # (NaN where t < 0)
            return False, f.minus(-1 / math.e, f.high(*ends)), f.minus(top, f.low(*ends))
        if name in LOSS_PARAMS:
            loss = self._loss(n)
            _, lo, hi = self.value(loss.x)
            if name == "nll_loss":  # -w[t] * x[t], 0 where ignored
                ends = [f.times(f.minus(0.0, a), b) for a in (lo, hi) for b in (loss.w_lo, loss.w_hi)]
                low, high = f.low(0.0, *ends), f.high(0.0, *ends)
            else:  # w[t] * (logsumexp(x) - x[t]) (and the smoothing's mean of such terms)
                top = f.times(f.magnitude(loss.w_lo, loss.w_hi),
                              f.plus(f.minus(hi, lo), f.call(torch.log, self.width)))
                low, high = f.low(0.0, f.minus(0.0, top)) if loss.weight is not None else 0.0, top
            weighs_0 = False if loss.smoothing else f.and_(loss.w_zero, self.finite(loss.x))
            zero = f.or_(loss.ignored, weighs_0)
            return zero, low, high
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

    def _kl_div(self, n: Node) -> tuple[Node, Any, bool]:
        """A ``kl_div(reduction='none')`` over the vocabulary, read: (input, target, log_target)."""
        params = LOSS_PARAMS["kl_div"]
        x, t = n.kwargs.get("input", n.args[0] if n.args else None), loss_arg(n, "target")
        log_target = loss_arg(n, "log_target", False)
        if len(n.args) > 1 + len(params) or set(n.kwargs) - {"input", *params} \
                or loss_arg(n, "reduction", "mean") != "none" or loss_arg(n, "size_average") is not None \
                or loss_arg(n, "reduce") is not None or not isinstance(log_target, bool):
            raise _NoRule(f"{n.name}: a kl_div the rule does not read")
        if not all(self.kind.get(a) == "wide" for a in (x, t, n)):
            raise _NoRule(f"{n.name}: a kl_div not over the vocabulary")
        return x, t, log_target

    def _loss(self, n: Node) -> "_Loss":
        """A ``cross_entropy`` / ``nll_loss`` of class indices, one value a row, read."""
        name, params = op_name(n), LOSS_PARAMS[op_name(n)]
        if len(n.args) > 1 + len(params) or set(n.kwargs) - {"input", *params}:
            raise _NoRule(f"{n.name}: arguments the rule does not read")
        x, t = n.kwargs.get("input", n.args[0] if n.args else None), loss_arg(n, "target")
        ii, weight = loss_arg(n, "ignore_index", -100), loss_arg(n, "weight")
        smoothing = loss_arg(n, "label_smoothing", 0.0) if name == "cross_entropy" else 0.0
        if loss_arg(n, "reduction", "mean") != "none" or loss_arg(n, "size_average") is not None \
                or loss_arg(n, "reduce") is not None or isinstance(ii, bool) or not isinstance(ii, int) \
                or isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)):
            raise _NoRule(f"{n.name}: a {name} the rule does not read")
        if self.kind.get(x) != "wide" or t not in self.exact or self.kind.get(t) != "row" \
                or self.dtype(t) in (None, torch.bool) or self.dtype(t).is_floating_point:
            raise _NoRule(f"{n.name}: a {name} not of class indices over the vocabulary")
        f = self.f
        ignored = f.call(operator.eq, self.value(t)[1], float(ii))
        if weight is None:
            return _Loss(x, ignored, smoothing, None, False, 1.0, 1.0)
        if not (isinstance(weight, Node) and weight in self.exact and self.kind.get(weight) == "whole"
                and tuple(self.values[weight].shape) == (self.vocab,)):
            raise _NoRule(f"{n.name}: a class weight that is not an input read whole")
        _, w_lo, w_hi = self.value(weight)
        rows = f.g.call_method("long", (f.g.call_method("reshape", (self.env[t], -1)),))
        picked = f.call(operator.getitem, self.env[weight], f.call(torch.where, ignored, 0, rows))
        w_zero = f.and_(f.call(operator.eq, picked, 0), f.finite(f.magnitude(w_lo, w_hi)))
        return _Loss(x, ignored, smoothing, weight, w_zero, w_lo, w_hi)

    def node_backward(self, n: Node, z: Any, m: Any) -> list[tuple[Any, Any, Any]]:
        f, name = self.f, op_name(n)
        hull = self._hull(n)
        if hull is not None:
            return [(hull[0], z, m)]
        if name in _REDUCE or name in _NORMALIZE:
            x = self._wide(n)
            bounded = self.finite(x)
            if name in ("sum", "amax", "amin"):
                return [(x, z, m)]
            if name == "mean":
                return [(x, z, f.over(m, self.width))]
            size = f.times(m, f.plus(self.width, 1.0))  # (g - p * sum(g): at most (1 + V) |g|)
            return [(x, f.and_(z, bounded), size)]
        if name == "gather" or _column(n):
            return [(n.args[0], z, m)]
        if name == "getitem" and self._top(n) is not None:  # (max's values: a slope of 0 or 1)
            return [(self._top(n)[1], z, m)]
        if name == "kl_div":
            x, t, log_target = self._kl_div(n)
            (_, xl, xh), (_, tl, th) = self.value(x), self.value(t)
            if log_target:  # d/dx = -exp(t), d/dt = exp(t) * (t - x + 1)
                slope_x = f.exp(th)
                slope_t = f.times(slope_x, f.plus(f.magnitude(f.minus(tl, xh), f.minus(th, xl)), 1.0))
            else:  # d/dx = -t, d/dt = log(t) + 1 - x
                slope_x = f.magnitude(tl, th)
                logs = f.magnitude(f.log(tl), f.log(th))
                slope_t = f.plus(f.plus(logs, 1.0), f.magnitude(xl, xh))
            return [(x, f.and_(z, f.finite(slope_x)), f.times(m, slope_x)),
                    (t, f.and_(z, f.finite(slope_t)), f.times(m, slope_t))]
        if name in LOSS_PARAMS:
            loss = self._loss(n)
            size = f.magnitude(loss.w_lo, loss.w_hi)
            w_ok = f.finite(size)  # (the gradient is a [rows, V] product with the weights)
            zero = f.or_(loss.ignored, z) if loss.smoothing else \
                f.or_(f.or_(loss.ignored, z), f.and_(loss.w_zero, f.finite(m)))
            zero = f.and_(zero, w_ok)
            if name == "nll_loss":
                return [(loss.x, zero, f.times(m, size))]
            # (an ignored row's cotangent is 0, but log-softmax's backward of it is ``0 * exp(lp)``)
            return [(loss.x, f.and_(self.finite(loss.x), zero), f.times(m, f.times(size, 2.0)))]
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

    def _top(self, r: Any) -> Optional[tuple[str, Node]]:
        """``("amax", x)`` when ``r`` is the row's largest logit ``x.amax(-1)`` (or
        ``x.max(-1)[0]`` / ``.values``), ``("logsumexp", x)`` for ``x.logsumexp(-1)``, with
        or without ``keepdim``: a value no entry of the row exceeds; else None."""
        if not isinstance(r, Node) or self.kind.get(r) != "row":
            return None
        if op_name(r) == "getitem" and r.args[1:] == (0,) and isinstance(r.args[0], Node):
            r = r.args[0]
            if op_name(r) != "max" or not (len(r.args) >= 2 or "dim" in r.kwargs):
                return None  # (not the maximum over a dim: ``_wide`` refuses a second tensor)
        elif op_name(r) not in ("amax", "logsumexp"):
            return None
        try:
            x = self._wide(r)
        except _NoRule:
            return None
        return ("logsumexp" if op_name(r) == "logsumexp" else "amax"), x

    def _row_top(self, r: Any) -> Optional[tuple[str, Node]]:
        """:meth:`_top` of a column ``[n, 1]`` (``keepdim=True``, or ``unsqueeze(-1)`` /
        ``[:, None]`` of one without): what ``x - r`` broadcasts over the row."""
        if r in self.tops:
            return self.tops[r]
        if not isinstance(r, Node) or self.kind.get(r) != "row" or tuple(self.values[r].shape)[1:] != (1,):
            return None
        unsqueezed = op_name(r) == "unsqueeze" and r.args[1:] in ((-1,), (1,)) and not r.kwargs
        if unsqueezed or _column(r):
            r = r.args[0]
            if not isinstance(r, Node) or self.kind.get(r) != "row" or self.values[r].dim() != 1:
                return None
        return self._top(r)

    def _relational(self, n: Node) -> Optional[Value]:
        """Facts the intervals alone lose (NOTE [rows a row-local body leaves out], the
        shifted logits): ``x - top`` with ``top`` a value no entry of ``x``'s row exceeds
        is at most 0, and ``exp(x - x.amax(-1, keepdim=True)).sum(-1)`` at least 1 (the
        largest entry adds ``exp(0)``).  None where neither applies."""
        f, name = self.f, op_name(n)
        if name == "sub" and n.op in ("call_function", "call_method") and len(n.args) == 2 and not n.kwargs:
            x, r = n.args
            top = self._row_top(r)
            if top is not None and top[1] is x:
                (vx, lx, _), (vr, _, ur) = self.value(x), self.value(r)
                self.shifted[n] = top[0]
                return f.and_(vx, vr), f.minus(lx, ur), 0.0
        if name == "getitem" and self._top(n) is not None:  # (the values of ``max(x, -1)``)
            return self.value(self._top(n)[1])
        if name == "sum" and self.kind.get(n) == "row":
            e = self._wide(n)
            if op_name(e) == "exp" and len(e.args) == 1 and self.shifted.get(e.args[0]) == "amax":
                v, lo, hi = self.value(e)
                return v, f.high(f.times(lo, self.width), 1.0), f.times(hi, self.width)
        return None

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
