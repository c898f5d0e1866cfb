"""``row_local_sweeps`` on the rows its results' readers count: a row-local region whose
lm_head runs inside its chunk loop and whose per-row results the graph keeps (a
distillation KL returned per token, a loss and its masked metric), with a mask that
leaves some rows' results unread.  See NOTE [row-local rows a mask leaves unread].
"""

# NOTE [row-local rows a mask leaves unread]
# The rewrite (``rewrite/skip_rows.skip_unread_region_rows``) builds one skip graph
# (``match/body_mask.skip_rows_of_region_reads``): the body's forward facts give each
# result an interval per row, the readers' rules (``match/tail_facts.py``) prove a row's
# values read are exactly 0 for any value in those intervals and its results' cotangents
# exactly 0 (each sum's incoming gradient taken as a finite number), and the body's
# backward rules carry those zeros to the logits.  The forward runs the loop, GEMMs
# included, on the other rows and writes each skipped row's result as a value of the
# result's dtype inside its interval (``rows.inside``): the graph's own ops then compute
# the zeros stock computes.  The backward runs both sweeps on the rows the forward ran
# where every skipped row's incoming cotangent is finite (the proof took each sum's
# incoming gradient as a finite number; a mask inside the body zeroes a skipped row's
# gradient whatever finite cotangent reaches it); where one is not (an infinite incoming
# gradient times a mask's 0 is NaN, and stock's gradients turn NaN with it) it runs every
# row, as stock, so stock's NaN pattern is the body's own.  That check reads
# the cotangents, and the backward reads the count of rows run: both are host memory on a
# CPU, so the call compacts on CPUs only (on a GPU they would be a second device read a
# step, and the check a third): for a region on another device the rewrite keeps
# ``row_local_sweeps`` and says why; the op itself runs every row on one.  Both ops are
# ``cudagraph_unsafe`` (a host tensor, host reads).

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .. import rows as rows_of
from ..ops import user_bodies
from ..ops.args import LogitsInput, Region, grads_by_name
from ..ops.pair import call_by_name, saved_inputs
from ..ops.registry import CUDAGRAPH_UNSAFE, UNSAFE, emitted
from .engine import fake_results, forward, region_grads, replay_args, setup_region, with_logits
from .split import split_of
from .sweeps import flat, row_local_sweeps_backward, run_sweeps

__all__ = ["row_local_sweeps_masked"]

HOST = torch.device("cpu")
F64 = torch.float64


def _kept_rows(region: Region, lm: LogitsInput, mask_key: str,
               operands: list[torch.Tensor]) -> tuple[Optional[torch.Tensor], list[torch.Tensor]]:
    """(the rows to run, ascending, or None for every row; each result's value for a
    skipped row): the skip graph ``mask_key`` on this step's inputs (module NOTE)."""
    h = lm.h
    if not mask_key or h.device.type != "cpu" or h.shape[0] == 0:
        return None, []
    z = rows_of.logit_bounds(h, lm.weight, lm.bias, None, False, "")
    width = torch.full((), float(lm.weight.shape[0]), dtype=F64, device=h.device)
    skip, *fills = user_bodies.function(mask_key)(width, z, *region.rows, *region.whole, *operands)
    kept = rows_of.select(skip.expand(h.shape[0]))
    if kept is not None and kept.shape[0] == 0:  # (every row left out: one runs, for the results' shapes)
        kept = torch.zeros(1, dtype=torch.int64, device=h.device)
    return kept, fills


@torch.library.custom_op("chunked_logits::row_local_sweeps_masked", mutates_args=(), tags=UNSAFE)
def _masked(key: str, rows: list[torch.Tensor], whole: list[torch.Tensor], budget_bytes: int, index: int,
            hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], how: str, mask_key: str,
            operands: list[torch.Tensor]) -> list[torch.Tensor]:
    # -> the body's results, the rows run (``[N]``, first ``count``), count (0-d, host memory)
    lm = LogitsInput(index, flat(hidden), weight, bias, how)
    return _masked_forward(Region(key, rows, whole, budget_bytes), lm, mask_key, operands)


def _masked_forward(region: Region, lm: LogitsInput, mask_key: str, operands: list[torch.Tensor]) -> list:
    """``row_local_sweeps_masked``'s results (module NOTE)."""
    n, dev = lm.h.shape[0], lm.h.device
    kept, fills = _kept_rows(region, lm, mask_key, operands)
    if kept is None:
        return [*forward(region, lm), torch.arange(n, device=dev), torch.tensor(n, device=HOST)]
    got = forward(dataclasses.replace(region, kept=kept), lm._replace(h=lm.h[kept]))
    results = []
    for r, fill in zip(got, fills):
        column = fill.to(r.dtype).reshape(-1, *[1] * (r.dim() - 1)).expand(n, *r.shape[1:])
        results.append(column.contiguous().index_copy_(0, kept, r))
    index_run = kept.new_zeros(n)
    index_run[:kept.shape[0]] = kept
    return [*results, index_run, torch.tensor(kept.shape[0], device=HOST)]


@_masked.register_fake
def _(key, rows, whole, budget_bytes, index, hidden, weight, bias, how, mask_key, operands):
    x = hidden.new_empty((flat(hidden).shape[0], weight.shape[0]))
    n = x.shape[0]
    return [*fake_results(key, with_logits(rows, index, x), whole), hidden.new_empty(n, dtype=torch.int64),
            hidden.new_empty((), dtype=torch.int64, device=HOST)]


def _kept_backward(key: str, outputs: list[int], region: Region, lm: LogitsInput, grads: list[torch.Tensor],
                   needs: list[bool], run: torch.Tensor) -> Optional[list[torch.Tensor]]:
    """Both sweeps on the rows ``run`` (the others' gradients exact zeros), or None where the
    body does not split (not expected: the rewrite split the same body)."""
    h = lm.h
    x_like = h.new_empty((0, lm.weight.shape[0]))
    split = split_of(key, [lm.index], outputs, lm.index, with_logits(region.rows, lm.index, x_like),
                     region.whole)
    if isinstance(split, str):
        return None
    heads = run_sweeps(split, dataclasses.replace(region, kept=run), lm._replace(h=h[run]), [lm.index],
                       [g[run] for g in grads], needs, [])
    grad_h, rest = heads[0], [t for t in heads[1:] if t is not None]
    if grad_h is None:
        return rest
    return [h.new_zeros(h.shape).index_copy_(0, run, grad_h), *rest]


@torch.library.custom_op("chunked_logits::row_local_sweeps_masked_backward", mutates_args=(), tags=UNSAFE)
def _masked_backward(key: str, wanted: list[int], outputs: list[int], rows: list[torch.Tensor],
                     whole: list[torch.Tensor], grads: list[torch.Tensor], budget_bytes: int, index: int,
                     hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], how: str,
                     needs: list[bool], kept: torch.Tensor, count: torch.Tensor) -> list[torch.Tensor]:
    h = flat(hidden)
    n, k = h.shape[0], int(count.tolist())  # (host memory: no op, no device sync)
    if k < n and not wanted and h.device.type == "cpu":
        run = kept[:k]
        skipped = torch.ones(n, dtype=torch.bool, device=h.device)
        skipped[run] = False
        if all(bool(g.reshape(n, -1)[skipped].isfinite().all()) for g in grads):  # (module NOTE: host memory)
            lm = LogitsInput(index, h, weight, bias, how)
            got = _kept_backward(key, outputs, Region(key, rows, whole, budget_bytes), lm, grads, needs, run)
            if got is not None:
                if needs[0]:
                    got[0] = got[0].view(hidden.shape)
                return got
    return row_local_sweeps_backward(key, wanted, outputs, rows, whole, grads, budget_bytes, index, hidden,
                                     weight, bias, how, needs)


@_masked_backward.register_fake
def _(key, wanted, outputs, rows, whole, grads, budget_bytes, index, hidden, weight, bias, how, needs, kept,
      count):
    shapes = [rows[i] for i in wanted]
    shapes += [t for need, t in zip(needs, (hidden, weight, bias)) if need and t is not None]
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in shapes]


def _setup(ctx, inputs, output):
    setup_region(ctx, _masked, inputs, output, kept=2)


def _backward(ctx, grads):
    args, extra = saved_inputs(ctx)
    kept, count = extra[-2:]
    if not ctx.outputs:
        return grads_by_name(_masked, ctx.lengths)
    got = call_by_name(_masked_backward, args, kept=kept, count=count, needs=ctx.needs,
                       **replay_args(ctx, grads, args["hidden"].device))
    return region_grads(_masked, ctx, args, got)


_masked.register_autograd(_backward, setup_context=_setup)


@emitted(("row_local_sweeps_masked", "row_local_sweeps_masked_backward"), CUDAGRAPH_UNSAFE)
def row_local_sweeps_masked(key: str, budget_bytes: int, n_rows: int, index: int, how: str,
                            hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                            *inputs: torch.Tensor, mask_key: str, mask_operands) -> tuple[torch.Tensor, ...]:
    """:func:`~fx_passes.kernels.row_local.sweeps.row_local_sweeps` on the rows the skip
    graph of its results' readers cannot leave out: ``mask_key``
    (``match/body_mask.skip_rows_of_region_reads``) and the tensors it reads,
    ``mask_operands`` (NOTE [row-local rows a mask leaves unread]; the rewrite puts this
    call in place of the plain one)."""
    rows, whole = list(inputs[:n_rows - 1]), list(inputs[n_rows - 1:])
    operands = [o.reshape(-1) if o.dim() else o for o in mask_operands]
    out = _masked(key, rows, whole, budget_bytes, index, hidden, weight, bias, how, mask_key, operands)
    return tuple(out[:-2])
