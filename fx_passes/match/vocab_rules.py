"""The rules over the vocabulary of a row-local body's facts (:class:`_VocabRules`, a mixin of
``match/body_facts._BodyInterpreter``): reductions and normalizations over the last dim,
a gather of one column a row, ``kl_div`` and ``cross_entropy`` / ``nll_loss`` with
``reduction='none'``, and the shifted logits' relations (``x - x.amax(-1)`` at most 0,
``exp(x - x.amax(-1)).sum(-1)`` at least 1).  See NOTE [rows a row-local body leaves out]
in ``match/body_mask.py``.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.fx import Node

from ..fx.graph_ops import op_name
from ..fx.op_rules import FLOATS
from .masks import _column
from .row_local import LOSS_PARAMS, loss_arg
from .tail_facts import Value, _NoRule

_REDUCE = {"sum", "mean", "amax", "amin", "logsumexp"}
_NORMALIZE = {"log_softmax", "softmax"}
_KWARGS = {"dim", "keepdim", "dtype", "_stacklevel"}


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


class _VocabRules:
    """The rules over the vocabulary, read with their host's facts (``f``, ``kind``, ``value``,
    ``finite``, ``width``, ``exact``, ``values``, ``vocab``, ``env``, ``dtype``, ``shifted``,
    ``tops``: ``match/body_facts._BodyInterpreter``'s)."""

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

    def vocab_forward(self, n: Node) -> Optional[Value]:
        """The facts of ``n`` by a rule over the vocabulary (the shifted logits' relations, a
        reduction or normalization over it, a column, a gather, ``kl_div``, ``cross_entropy``
        / ``nll_loss``); None where none applies."""
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

    def vocab_backward(self, n: Node, z: Any, m: Any) -> Optional[list[tuple[Any, Any, Any]]]:
        """The cotangent facts ``n`` passes to its operands by a rule over the vocabulary;
        None where none applies."""
        f, name = self.f, op_name(n)
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
        return None

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
