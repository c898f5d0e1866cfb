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

from typing import Optional

import torch
from torch.fx import Graph, GraphModule, Node

from ..kernels.ops import user_bodies
from .loss_tail import LossTail
from .skip_graph import _Facts
from .tail_facts import _Interpreter, say_why

__all__ = ["skip_rows_body", "skip_rows_of_reads", "ITEMS"]

ITEMS = ("lse_lo", "lse_hi", "lp_lo", "lp_hi", "ent_lo", "ent_hi")


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
