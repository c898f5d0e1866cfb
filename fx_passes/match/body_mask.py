"""Rows a row-local loss leaves out: the skip graph of a region's body joined with its
loss tail (``rewrite/loss_tail.rewrite_row_loss_tail``).

:func:`skip_rows_of_body` builds ``skip(width, z, *rows, *whole, *weights) -> bool [rows]``
(``z``: the logits' bound a row, ``kernels/rows.logit_bounds``; ``rows`` / ``whole``: the
joined body's inputs but the logits; ``weights``: each sum's ``d loss / d row value``):
True where every value the loss sums is exactly 0 and the logits get an exactly-zero
gradient, so ``row_local_loss`` may leave the row out of its loop, GEMMs included.  Same
facts and rules as the lm_head path's (``match/row_mask.py``, NOTE [rows a loss leaves
out]), read through the body too.  See NOTE [rows a row-local body leaves out].
"""

# NOTE [rows a row-local body leaves out]
# A row-local body (a distillation KL, a z-loss, a policy loss) is the user's own ops on
# the row's logits and its other row inputs; the mask may be inside it (``kl * mask``
# before the tail's ``.sum() / mask.sum()``) or in the tail.  Stock's answer for a masked
# row is 0 only where every value on the way is finite (``0 * inf`` is NaN), in the forward
# and in the gradient (a zero cotangent times an infinite derivative).  So the body is read
# with the same two facts per node (exactly 0 / an interval holding it; a zero cotangent /
# a bound on it), per row, at run time:
#
# * the logits' interval is ``[-z, z]``; a wide row input (a teacher's logits) its row's
#   ``[min, max]``; values computed from the row inputs that are one per row (a mask's
#   ``.float()``, ``labels != -100``) are computed exactly;
# * reductions over the vocabulary (``sum``, ``mean``, ``amax`` / ``amin``,
#   ``logsumexp``, ``log_softmax``, ``softmax``, ``gather``; ``kl_div``, ``cross_entropy`` /
#   ``nll_loss`` with ``reduction='none'``: the last two 0 where ``ignore_index`` leaves the
#   row out or, unsmoothed, its class weighs 0) bound their results from their input's interval and the row's
#   width and pass a zero cotangent where their input's interval is finite (their
#   derivatives are then bounded); the vocabulary's size (``x.size(-1)``) is a number;
# * only values one per row ``[n]`` / ``[n, 1]``, the vocabulary's ``[n, V]`` and values
#   read whole are taken: the body is run once on a small example at rewrite time to
#   read each node's shape; any other shape, or an op with no rule, gives "unknown" (its
#   rows are computed, never guessed);
# * the shifted logits: the logits' bound ``z`` is loose (``|h|_1 * max|W|``), and an
#   FP32 ``exp`` of more than 88 is unknown, so intervals alone lose a log-softmax written
#   by hand.  Three relations are kept (``_relational``): ``x - x.amax(-1, keepdim=True)``
#   (``max(..)[0]``; without ``keepdim`` as a column) and
#   ``x - x.logsumexp(-1, keepdim=True)`` are at most 0 (rounding is monotone:
#   ``x_i <= max <= lse`` holds in floating point too), and
#   ``exp(x - x.amax(-1, keepdim=True)).sum(-1)`` is at least 1 (its largest entry is
#   ``exp(0)``, the others add nothing negative).

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch.fx import Graph, GraphModule, Node

from ..kernels.ops import user_bodies
from ..kernels.rows import inside
from .body_facts import BodyExample, _body_backward, _BodyInterpreter, _shapes, only_indices
from .loss_tail import LossTail
from .masks import masks_among, why_every_row
from .skip_graph import _Facts
from .tail_facts import Value, _Interpreter, say_why

__all__ = ["skip_rows_of_body", "skip_rows_of_region_reads"]


def _run_body(body_key: str, index: int, rows: tuple, whole: tuple,
              masks: set[int]) -> Optional[tuple[GraphModule, _Facts, _BodyInterpreter, Node]]:
    """(the body ``body_key``, a skip graph's facts, the forward facts of every node of the
    body as nodes of that graph, its placeholder ``z``): the graph's placeholders are
    ``width``, ``z`` and the body's inputs but the logits (``input{i}``); None where the
    body does not run on the shape-reading example."""
    body = user_bodies.function(body_key)
    f = _Facts(Graph())
    places = [p for p in body.graph.nodes if p.op == "placeholder"]
    try:
        values = _shapes(body, list(rows), list(whole))
    except Exception:  # noqa: BLE001 - a body that does not run on the example: every row runs
        return None
    g = f.g
    width, z = g.placeholder("width"), g.placeholder("z")
    run = _BodyInterpreter(f, BodyExample(body, values, places[index], rows[index][1][-1]), width,
                           {places[i] for i in masks if i < len(rows) and not only_indices(places[i])})
    for i, p in enumerate(places):
        run.env[p] = x = z if i == index else g.placeholder(f"input{i}")
        if p not in run.exact:
            run.input_place(p, x)
    run.run_nodes(body)
    return body, f, run, z


def skip_rows_of_body(body_key: str, index: int, rows: tuple, whole: tuple, n_sums: int,
                      masks: set[int], why: Optional[list[str]] = None) -> Optional[str]:
    """The registered key of ``skip(width, z, *rows but the logits, *whole, *weights)`` for
    the joined body ``body_key`` (its row inputs' and whole inputs' ``(dtype, shape,
    device)``, the logits at ``index``; ``n_sums`` values summed; ``masks``: the row
    inputs' positions that are masks, a masked mean's), or None when no row can be skipped
    (where the body has a mask, the reason appended to ``why``: NOTE [why every row runs])."""
    found = _run_body(body_key, index, rows, whole, masks)
    if found is None:
        return None
    body, f, run, z = found
    weights = [f.g.placeholder(f"weight{k}") for k in range(n_sums)]
    sums = list(next(iter(body.graph.find_nodes(op="output"))).args[0])
    skip: Any = True
    for s in sums:
        skip = f.and_(skip, run.value(s)[0] if s in run.inner else False)

    def refused() -> None:
        unmasked = [f"the loss sums {s.name} on every row, unmasked" for s in sums
                    if s not in run.inner or run.value(s)[0] is False]
        reason = why_every_row(bool(run.masks), run.unknown, unmasked)
        if reason is not None and why is not None:
            why.append(reason)
    if skip is False:
        refused()
        return None
    Zc = _body_backward(run, body, [(s, f.call(operator.eq, w, 0), f.call(torch.abs, w))
                                    for s, w in zip(sums, weights)])
    skip = f.and_(skip, Zc.get(run.logits, True))
    skip = f.and_(skip, f.call(torch.isfinite, z))
    if skip is False:
        refused()
        return None
    f.g.output(skip)
    return user_bodies.register(GraphModule(torch.nn.Module(), f.g))


def skip_rows_of_region_reads(body_key: str, index: int, rows: tuple, whole: tuple, tail: LossTail,
                              masks: set[int],
                              why: Optional[list[str]] = None) -> Optional[tuple[str, list[Node]]]:
    """The skip graph of a row-local region whose per-row results the graph keeps
    (``row_local_sweeps_masked``): ``skip(width, z, *rows but the logits, *whole,
    *operands) -> (bool [rows], fill_0, fill_1, ..)``, True where every value the
    results' readers ``tail`` (``match.loss_tail.match_region_reads``) read is exactly 0
    whatever each result holds in its interval (the body's forward facts, NOTE [rows a
    row-local body leaves out]; ``fill_i``: a value of result ``i``'s dtype in it, what a
    skipped row's result is written as, ``kernels/rows.inside``), and the readers' zero cotangents, carried
    back through the body, give the logits an exactly-zero gradient.  Each sum's incoming
    gradient is taken as a finite number (the op's backward runs every row where a
    skipped row's cotangent is not 0).  Returns its key and the tail's operands it reads,
    in order (``masks``: the body's row inputs that are masks); None when no row can be
    skipped (the reason appended to ``why`` where the reads have a mask)."""
    found = _run_body(body_key, index, rows, whole, masks)
    if found is None:
        return None
    body, f, run, z = found
    results = list(next(iter(body.graph.find_nodes(op="output"))).args[0])
    items: list[Value] = []
    for r in results:
        if not isinstance(r, Node) or run.kind.get(r) != "row":  # (a top-k's ``[n, k]``)
            if why is not None and (run.masks or masks_among(tail, tail.row_operands)):
                why.append(f"the region's result {getattr(r, 'name', r)} is not one value a row: only such "
                           "results are skipped")
            return None
        items.append(run.value(r))
    operands = [*tail.row_operands, *tail.whole]
    env: dict[Node, Node] = {o: f.g.placeholder(f"operand{i}") for i, o in enumerate(operands)}
    reads = _Interpreter(f, tail, env)
    leaving = [n for n in tail.leaving if n in reads.inner]
    skip = reads.forward([], leaving, items)
    if skip is not False:
        reads.backward([1.0] * len(tail.reductions), leaving)
        seeds = [(results[i], *reads.cotangents[item]) for item, i in tail.items.items()]
        skip = f.and_(skip, _body_backward(run, body, seeds).get(run.logits, True))
    if skip is False:
        say_why(reads, leaving, why, run.unknown, bool(run.masks))
        return None
    fills = []
    for r, (_, lo, hi) in zip(results, items):  # (a value of the result's dtype in its interval, per row)
        fill = f.g.call_function(inside, (lo, hi, run.dtype(r)))
        skip = f.and_(skip, f.call(operator.getitem, fill, 1))
        fills.append(f.call(operator.getitem, fill, 0))
    f.g.output((f.and_(skip, f.call(torch.isfinite, z)), *fills))
    read = [o for o in operands if env[o].users]
    for o in operands:
        if not env[o].users:
            f.g.erase_node(env[o])
    return user_bodies.register(GraphModule(torch.nn.Module(), f.g)), read
