"""Gradients in the forward for a row-local region whose lm_head runs chunk by chunk,
when the graph reduces its per-row results to the scalar loss it returns.

Contract: the rewrite (:func:`fx_passes.rewrite.loss_tail.rewrite_row_loss_tail`) joins
the region's body and the loss's row part (:mod:`fx_passes.match.loss_tail`) into one body
``key``; its cotangents for a unit loss are constants, so the forward also runs the body's
gradient, per row chunk: the logits GEMM, the split body's ``stats`` graph
(:mod:`fx_passes.kernels.row_local.split`) and ``grad_hidden[rows] = g @ weight``.  The backward
runs the vocabulary sweep of :mod:`fx_passes.kernels.row_local.sweeps` only: four
``[T, H] x [H, V]`` GEMMs a step instead of five.  Results are those of the body's own
gradient, each gradient one FP32 sum rounded once: where scaling by the incoming gradient
would round again (not 1 or a power of two), or the body does not split at run time,
the backward runs both sweeps with the scaled cotangents.  On plan ``"gpu"`` see NOTE
[gpu plan: gradients in the forward].
"""

# NOTE [gpu plan: gradients in the forward]
# On GPUs (torch.mm/addmm(..., out_dtype=torch.float32)) the forward also sums grad_weight
# and the bias's gradient over the row chunks in FP32 buffers (4 V H bytes) and keeps
# grad_hidden in FP32; the backward scales each by the incoming gradient on the device,
# whatever it is (g is not read: no host sync), and rounds once, in blocks the budget
# holds: three GEMMs a step, stock's count, no vocabulary sweep.  The logits' gradient is
# rounded for a unit loss (stock rounds it scaled): one rounding each, as close to FP64 as
# stock's over seeds (docs/gpu.md, "Host syncs").  The forward's `done` is not read on a
# GPU; the CPU plan reads it and g on a CPU only (host memory).

# NOTE [row-local loss memory]
# Plan "gpu" holds its FP32 sums (4 V H + 4 T H bytes) and only what the maths needs on top:
# one row chunk's logits, their gradient written in their place by the stats graph's last
# kernel (sweeps.stats_into: one [r, V] tile a chunk, not two), dropped before the next
# chunk's logits are made; the backward's
# grad_hidden call comes first, so the compiled backward frees the [T, H] sum before the
# weight's call rounds grad_weight (6 V H + 2 T H at its end).  Same ops in the same order.

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Optional

import torch

from ...reporting.report import say_once
from .. import rows as rows_of
from ..log_softmax.loss_parts import (
    add_fp32_grads,
    final_loss,
    loss_of_sums,
    power_of_two,
    reductions_of,
    row_weights,
    scale_exactly_,
    scaled_exactly,
)
from ..ops import user_bodies
from ..ops.args import LogitsInput, Region, RowLossOptions, grads_by_name
from ..ops.pair import call_by_name, save_inputs, saved_inputs, taken
from ..ops.registry import CAPTURE_SAFE, emitted
from ..tiling import even_splits, product_cols, resolve_budget
from .engine import forward, with_logits
from .split import Split, split_of
from .sweeps import block_sweep, flat, row_local_sweeps_backward, row_sweep, run_sweeps, stats_into

__all__ = ["row_local_loss", "row_bytes"]

F32, F64 = torch.float32, torch.float64


def row_bytes(split: Split) -> int:
    """Bytes a row of the split's per-row values takes (packed as ``uint8`` columns)."""
    return sum(torch.Size(rest).numel() * dtype.itemsize for dtype, rest in split.value_specs)


def _pack(buf: torch.Tensor, values) -> None:
    off = 0
    for v in values:
        b = v.reshape(v.shape[0], -1).contiguous().view(torch.uint8)
        buf[:, off:off + b.shape[1]] = b
        off += b.shape[1]


def _unpack(buf: torch.Tensor, split: Split) -> list[torch.Tensor]:
    out, off = [], 0
    for dtype, rest in split.value_specs:
        nb = torch.Size(rest).numel() * dtype.itemsize
        out.append(buf[:, off:off + nb].contiguous().view(dtype).reshape(buf.shape[0], *rest))
        off += nb
    return out


def _split(region: Region, lm: LogitsInput, k: int):
    x_like = lm.h.new_empty((0, lm.weight.shape[0]))  # (the logits' dtype, width and device)
    rows = with_logits(region.rows, lm.index, x_like)
    return split_of(region.key, [lm.index], list(range(k)), lm.index, rows,
                    region.whole, with_outputs=True)


def _say_unsplit(key: str, why: str) -> None:
    say_once(logging.WARNING, "chunked_logits: the row-local loss %s did not split at run time (%s): its "
             "gradients are computed in the backward, by both sweeps (same results, one GEMM more)", key, why)


@torch.library.custom_op("chunked_logits::row_local_loss", mutates_args=())
def _row_local_loss(key: str, rows: list[torch.Tensor], whole: list[torch.Tensor], budget_bytes: int,
                    index: int, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    how: str, final_key: str, kinds: str, n_final: int, width: int, plan: str,
                    needs: list[bool], mask_key: str) -> list[torch.Tensor]:
    # -> [loss, grad_hidden, the per-row values packed (``[N, width]`` uint8: the rows run
    #     first), 1 if the gradients were computed (the body split) else 0, grad_weight,
    #     grad_bias, the rows run (``[N]``, first ``count``), count]: for a unit loss;
    #     "two_sweeps": grad_hidden in model precision; "gpu": all three in FP32
    lm = LogitsInput(index, flat(hidden), weight, bias, how)
    loss = RowLossOptions(final_key, kinds, n_final, width, plan)
    return _forward_kept(Region(key, rows, whole, budget_bytes), lm, loss, needs, mask_key)


def _forward_kept(region: Region, lm: LogitsInput, loss: RowLossOptions, needs: list[bool],
                  mask_key: str) -> list[torch.Tensor]:
    """:func:`_row_local_loss`'s results: :func:`_forward` on the rows the skip graph
    ``mask_key`` keeps (all of them for "")."""
    n, dev = lm.h.shape[0], lm.h.device
    weights = row_weights(loss.final_key, loss.kinds, loss.final_whole(region.whole), n, dev)
    kept = _kept_rows(region, lm, loss.plan, mask_key, weights)
    if kept is None:
        out = _forward(region, lm, loss, needs, n)
        return [*out, torch.arange(n, device=dev), torch.full((), n, dtype=torch.int64, device=dev)]
    # the loop on the rows that count; the others' values and gradients are exact zeros
    out = _forward(dataclasses.replace(region, kept=kept), lm._replace(h=lm.h[kept]), loss, needs, n)
    if needs[0]:
        out[1] = out[1].new_zeros(n, out[1].shape[1]).index_copy_(0, kept, out[1])
    packed = out[2].new_zeros(n, out[2].shape[1])
    packed[:kept.shape[0]] = out[2]
    out[2] = packed
    index = torch.zeros(n, dtype=torch.int64, device=dev)
    index[:kept.shape[0]] = kept
    return [*out, index, torch.full((), kept.shape[0], dtype=torch.int64, device=dev)]


def _kept_rows(region: Region, lm: LogitsInput, plan: str, mask_key: str,
               weights: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """The rows the loop must run (ascending), or None for all of them: those the joined
    body's skip graph ``mask_key`` (``match/body_mask.py``) cannot prove exactly zero in
    value and gradient.  The ``"two_sweeps"`` backward reads the count from host memory:
    that plan compacts on CPUs only."""
    h, weight = lm.h, lm.weight
    if not mask_key or (plan != "gpu" and h.device.type != "cpu"):
        return None
    z = rows_of.logit_bounds(h, weight, lm.bias, None, False, "")
    width = torch.full((), float(weight.shape[0]), dtype=F64, device=h.device)
    skip = user_bodies.function(mask_key)(width, z, *region.rows, *region.whole, *weights)
    return rows_of.select(skip.expand(h.shape[0]))


def _forward(region: Region, lm: LogitsInput, loss: RowLossOptions, needs: list[bool],
             total: int) -> list[torch.Tensor]:
    """:func:`_row_local_loss`'s first six results for the rows of ``region`` / ``lm``
    (``total``: every row's count, a mean's)."""
    h, weight, bias, plan = lm.h, lm.weight, lm.bias, loss.plan
    dev = h.device
    reductions = reductions_of(loss.kinds)
    final_whole = loss.final_whole(region.whole)
    sums = [torch.zeros((), dtype=F64, device=dev) for _ in reductions]
    grad_h, packed, grad_w, grad_b = _gradients(h, weight, bias, loss.width, plan, needs, torch.zeros)
    split = _split(region, lm, len(reductions))
    done = isinstance(split, Split) and (plan == "gpu" or row_bytes(split) == loss.width)
    if not done:  # (not expected: the rewrite split the same body) the results only
        _say_unsplit(region.key, split if isinstance(split, str) else "another layout of its per-row values")
        for s, o in zip(sums, forward(region.gathered(), lm)):
            s += o.sum(dtype=F64)
    else:
        weights = row_weights(loss.final_key, loss.kinds, final_whole, total, dev)
        stats = stats_into(split, ("loss_stats", region.key, id(split)), lm.index)
        k = split.outputs  # (the stats graph: the logits' gradient, the results, the per-row values)
        cols = product_cols(resolve_budget(region.budget_bytes, dev), weight.shape[0], weight.shape[1])

        def cotangents(a: int, b: int) -> list[torch.Tensor]:
            return [w.to(dt).expand(b - a).contiguous() for w, (_, dt) in zip(weights, reductions)]
        for a, b, (g, *got) in row_sweep(stats, region, lm, cotangents, plan != "gpu" and needs[1]):
            for i, s in enumerate(sums):  # (got: the results, then the per-row values)
                s += got[i].sum(dtype=F64)
            if plan == "gpu":
                add_fp32_grads(g, h[a:b], weight, grad_h[a:b] if needs[0] else None,
                               grad_w if grad_w.numel() else None, grad_b if grad_b.numel() else None, cols)
            else:
                if needs[0]:
                    torch.mm(g, weight, out=grad_h[a:b])
                _pack(packed[a:b], got[k:])
            del g, got  # (one chunk's gradient at a time: NOTE [row-local loss memory])
    value = loss_of_sums(loss.final_key, loss.kinds, sums, total, final_whole)
    return [value, grad_h, packed, torch.full((), int(done), dtype=torch.int8, device=dev), grad_w, grad_b]


def _gradients(h, weight, bias, width: int, plan: str, needs: list[bool], make) -> list[torch.Tensor]:
    """The forward's buffers: grad_hidden, packed values, grad_weight, grad_bias (empty
    where not needed); ``make``: ``torch.zeros`` or ``torch.empty``."""
    gpu, n = plan == "gpu", h.shape[0]

    def made(need: bool, shape, dtype) -> torch.Tensor:
        return make(shape if need else (0,), dtype=dtype, device=h.device)
    return [made(needs[0], h.shape, F32 if gpu else h.dtype),
            made(True, (n, 0 if gpu else width), torch.uint8),
            made(gpu and needs[1], weight.shape, F32),
            made(gpu and bias is not None and needs[2], (weight.shape[0],), F32)]


@_row_local_loss.register_fake
def _(key, rows, whole, budget_bytes, index, hidden, weight, bias, how, final_key, kinds, n_final, width,
      plan, needs, mask_key):
    h = flat(hidden)
    at = [torch.zeros((), dtype=dt, device=h.device) for _, dt in reductions_of(kinds)]
    loss = final_loss(final_key, at, whole[len(whole) - n_final:])
    grad_h, packed, grad_w, grad_b = _gradients(h, weight, bias, width, plan, needs, torch.empty)
    done = torch.empty((), dtype=torch.int8, device=h.device)
    kept = torch.empty(h.shape[0], dtype=torch.int64, device=h.device)
    count = torch.empty((), dtype=torch.int64, device=h.device)
    return [torch.empty_like(loss), grad_h, packed, done, grad_w, grad_b, kept, count]


@torch.library.custom_op("chunked_logits::row_local_loss_backward", mutates_args=())
def _row_local_loss_backward(g: torch.Tensor, key: str, rows: list[torch.Tensor], whole: list[torch.Tensor],
                             budget_bytes: int, index: int, hidden: torch.Tensor, weight: torch.Tensor,
                             bias: Optional[torch.Tensor], how: str, final_key: str, kinds: str, n_final: int,
                             grad_hidden: torch.Tensor, packed: torch.Tensor, done: torch.Tensor,
                             grad_weight: torch.Tensor, grad_bias: torch.Tensor, kept: torch.Tensor,
                             count: torch.Tensor, plan: str, needs: list[bool]) -> list[torch.Tensor]:
    """The gradients ``needs`` asks for (of hidden, weight, bias), for the incoming ``g``
    (``kept[:count]``: the rows the forward ran; the others' gradients exact zeros)."""
    loss = RowLossOptions(final_key, kinds, n_final, 0, plan)  # (the width is not read)
    lm = LogitsInput(index, flat(hidden), weight, bias, how)
    made = (grad_hidden, packed, done, grad_weight, grad_bias)
    heads = _backward_kept(g, Region(key, rows, whole, budget_bytes), lm, loss, made, (kept, count), needs)
    if needs[0]:
        heads[0] = heads[0].view(hidden.shape)
    return heads


def _backward_kept(g: torch.Tensor, region: Region, lm: LogitsInput, loss: RowLossOptions, made: tuple,
                   kept: tuple[torch.Tensor, torch.Tensor], needs: list[bool]) -> list[torch.Tensor]:
    """:func:`_backward_of` on the rows the forward ran (``kept``: their indices, first
    ``count``; the others' gradients exact zeros); grad_hidden ``[N, H]``."""
    n = lm.h.shape[0]
    index, count = kept
    k = n if loss.plan == "gpu" or lm.h.device.type != "cpu" else int(count)  # (host memory on a CPU)
    if k == n:
        return _backward_of(g, region, lm, loss, made, needs, n) or _both_sweeps(g, region, lm, loss, needs)
    if g.device.type == "cpu" and math.isfinite(g.item()):
        rows_run = index[:k]
        grad_hidden, packed, done, grad_weight, grad_bias = made
        run, lm_run = dataclasses.replace(region, kept=rows_run), lm._replace(h=lm.h[rows_run])
        heads = _backward_of(g, run, lm_run, loss, (grad_hidden, packed[:k], done, grad_weight, grad_bias),
                             needs, n) or _kept_sweeps(g, run, lm_run, loss, needs, n)
        if heads is not None:
            return heads
    # every row (a ``g`` that is not finite: stock's ``0 * inf`` at a masked row is NaN)
    return _both_sweeps(g, region, lm, loss, needs)


def _kept_sweeps(g: torch.Tensor, region: Region, lm: LogitsInput, loss: RowLossOptions, needs: list[bool],
                 total: int) -> Optional[list[torch.Tensor]]:
    """Both sweeps on the kept rows of ``region`` / ``lm`` (an incoming gradient the
    forward's cannot be scaled by exactly), from the cotangents scaled by ``g``; the
    others' gradients exact zeros (grad_hidden ``[total, H]``).  None where the body does
    not split (not expected: the rewrite split the same body)."""
    k, reductions = lm.h.shape[0], reductions_of(loss.kinds)
    x_like = lm.h.new_empty((0, lm.weight.shape[0]))
    split = split_of(region.key, [lm.index], list(range(len(reductions))), lm.index,
                     with_logits(region.rows, lm.index, x_like), region.whole)
    if isinstance(split, str):
        return None
    weights = row_weights(loss.final_key, loss.kinds, loss.final_whole(region.whole), total, lm.h.device)
    grads = [(w * g).to(dt).expand(k).contiguous() for w, (_, dt) in zip(weights, reductions)]
    heads = [t for t in run_sweeps(split, region, lm, [lm.index], grads, needs, []) if t is not None]
    if needs[0]:
        heads[0] = heads[0].new_zeros(total, heads[0].shape[1]).index_copy_(0, region.kept, heads[0])
    return heads


def _backward_of(g: torch.Tensor, region: Region, lm: LogitsInput, loss: RowLossOptions, forward_made: tuple,
                 needs: list[bool], total: int) -> list[torch.Tensor]:
    """:func:`_row_local_loss_backward` on the rows of ``region`` / ``lm`` (``forward_made``:
    the forward's grad_hidden ``[total, H]``, packed per-row values of these rows, ``done``
    flag, grad_weight, grad_bias; ``total``: every row's count, a mean's); grad_hidden
    ``[total, H]``; None where both sweeps must run (:func:`_both_sweeps`)."""
    h, weight, bias = lm.h, lm.weight, lm.bias
    n, dev = h.shape[0], h.device
    grad_hidden, packed, done, grad_weight, grad_bias = forward_made
    reductions = reductions_of(loss.kinds)
    if loss.plan == "gpu" and isinstance(_split(region, lm, len(reductions)), Split):
        # each FP32 sum times g on the device, rounded once (g not read: no host sync);
        # ``done`` is not read (the forward split the same body: ``_split`` is a function
        # of the key and the shapes)
        pairs = zip(needs, (grad_hidden, grad_weight, grad_bias), (h, weight, bias))
        return [_rounded(t, g, like, region.budget_bytes)
                for need, t, like in pairs if need and like is not None]
    weights = row_weights(loss.final_key, loss.kinds, loss.final_whole(region.whole), total, dev)
    # the CPU plan's ``done`` and ``g`` (host values on a CPU); on another device both sweeps
    host = dev.type == "cpu" and g.device.type == "cpu"
    split = _split(region, lm, len(reductions)) if host and int(done) else None
    if isinstance(split, Split):
        unit = [w.to(dt).expand(n).contiguous() for w, (_, dt) in zip(weights, reductions)]
        return _from_the_forward(split, region, lm, unit, grad_hidden, packed, g.item(), needs)
    return None


def _both_sweeps(g: torch.Tensor, region: Region, lm: LogitsInput, loss: RowLossOptions,
                 needs: list[bool]) -> list[torch.Tensor]:
    """Both sweeps over every row, from the cotangents scaled by ``g`` (each gradient still
    one FP32 sum rounded once)."""
    n = lm.h.shape[0]
    reductions = reductions_of(loss.kinds)
    weights = row_weights(loss.final_key, loss.kinds, loss.final_whole(region.whole), n, lm.h.device)
    grads = [(w * g).to(dt).expand(n).contiguous() for w, (_, dt) in zip(weights, reductions)]
    return row_local_sweeps_backward(region.key, [], list(range(len(reductions))), region.rows, region.whole,
                                      grads, region.budget_bytes, lm.index, lm.h, lm.weight, lm.bias, lm.how,
                                      needs)


def _rounded(t: torch.Tensor, g: torch.Tensor, like: torch.Tensor, budget_bytes: int) -> torch.Tensor:
    """``(t * g).to(like.dtype)`` in blocks of rows whose FP32 product fills the budget (one
    block, or a few, at a GPU's budget: no FP32 copy of a whole ``[V, H]`` ``t``)."""
    out = torch.empty(t.shape, dtype=like.dtype, device=t.device)
    width = max(1, t[0].numel()) if t.dim() > 1 and t.shape[0] else 1
    for a, b in even_splits(t.shape[0], resolve_budget(budget_bytes, t.device) // (4 * width)):
        torch.mul(t[a:b], g, out=out[a:b])
    return out


def _from_the_forward(split: Split, region: Region, lm: LogitsInput, unit: list[torch.Tensor],
                      grad_hidden: torch.Tensor, packed: torch.Tensor, scale: float,
                      needs: list[bool]) -> Optional[list[torch.Tensor]]:
    """The gradients from the forward's ``grad_hidden`` and per-row values, or None
    where scaling them by ``scale`` would round (the backward then runs both sweeps).
    The per-row values were computed for a unit loss (``unit``: its cotangents; sums of
    their products among the values), so the vocabulary sweep runs on the unit cotangents
    too and its gradients are scaled after it: exact for 1, -1, a power of two."""
    if not power_of_two(scale):
        return None
    heads = [None, *block_sweep(split, region, lm, unit, _unpack(packed, split), needs)]
    if not all(scale_exactly_(t, scale) for t in heads[1:] if t is not None):
        return None  # (an element under- or overflowed: not expected)
    if needs[0]:  # (after the sweep: its working set and the scaled copy are not held together)
        heads[0] = scaled_exactly(grad_hidden, scale)
        if heads[0] is None:
            return None
    return [t for t in heads if t is not None]


@_row_local_loss_backward.register_fake
def _(g, key, rows, whole, budget_bytes, index, hidden, weight, bias, how, final_key, kinds, n_final,
      grad_hidden, packed, done, grad_weight, grad_bias, kept, count, plan, needs):
    return [torch.empty_like(t) for need, t in zip(needs, (hidden, weight, bias)) if need and t is not None]


# the forward's results past the loss, saved for the backward (its inputs of these names)
_MADE = ("grad_hidden", "packed", "done", "grad_weight", "grad_bias", "kept", "count")


def _setup(ctx, inputs, output):
    args = save_inputs(ctx, _row_local_loss, inputs, extra=output[1:])
    ctx.needs = list(args["needs"])  # (which of hidden, weight, bias take a gradient)


def _backward(ctx, grads):
    g = grads[0]  # (the loss's; the other results are the backward's own inputs)
    args, made = saved_inputs(ctx)
    if g is None or not any(ctx.needs):
        return grads_by_name(_row_local_loss, ctx.lengths)
    got = _backward_calls(g, args, dict(zip(_MADE, made)), ctx.needs)
    return grads_by_name(_row_local_loss, ctx.lengths, **taken(iter(got), ctx.needs, args))


def _backward_calls(g: torch.Tensor, args: dict, made: dict, needs: list[bool]) -> list[torch.Tensor]:
    """The backward op's gradients (plan "gpu": two calls, NOTE [row-local loss memory])."""
    if args["plan"] != "gpu" or not needs[0] or not any(needs[1:]):
        return call_by_name(_row_local_loss_backward, args, g=g, **made)
    none = torch.empty(0, dtype=F32, device=args["hidden"].device)  # (a sum the call does not read)
    first = {**made, "grad_weight": none, "grad_bias": none, "needs": [True, False, False]}
    rest = {**made, "grad_hidden": none, "needs": [False, *needs[1:]]}
    return [t for more in (first, rest) for t in call_by_name(_row_local_loss_backward, args, g=g, **more)]


_row_local_loss.register_autograd(_backward, setup_context=_setup)


@emitted(("row_local_loss", "row_local_loss_backward"), CAPTURE_SAFE)
def row_local_loss(key: str, budget_bytes: int, n_rows: int, index: int, how: str, hidden: torch.Tensor,
                   weight: torch.Tensor, bias: Optional[torch.Tensor], final_key: str, kinds: str,
                   n_final: int, width: int, plan: str, *inputs: torch.Tensor,
                   mask_key: str = "") -> torch.Tensor:
    """Called from rewritten graphs: the scalar loss of a row-local region (row input
    ``index``: the logits ``hidden @ weight.T``, ``how``: ``"linear"`` or ``"matmul"``)
    and its loss tail, joined in body ``key``.  ``inputs``: the ``n_rows - 1`` other row
    inputs (the tail's per-row tensors flat), then the tensors read whole, the loss's
    scalar part's ``n_final`` last; ``width``: bytes a row of the split's per-row values;
    ``plan``: ``"gpu"`` (``grad_weight`` summed over the row chunks by FP32-output GEMMs)
    or ``"two_sweeps"`` (by the backward's vocabulary sweep); ``mask_key``: the joined
    body's skip graph (:mod:`fx_passes.match.body_mask`), "" for none."""
    rows, whole = list(inputs[:n_rows - 1]), list(inputs[n_rows - 1:])
    needs = [t is not None and t.requires_grad for t in (hidden, weight, bias)]
    return _row_local_loss(key, rows, whole, budget_bytes, index, hidden, weight, bias, how, final_key, kinds,
                           n_final, width, plan, needs, mask_key)[0]
