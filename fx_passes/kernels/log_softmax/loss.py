"""Gradients in the forward: the lm_head loop when the graph reduces its results to the loss.

When a fused lm_head region's per-row results reach the graph's scalar loss only through
row-local ops and affinely combined sums / means (:mod:`fx_passes.match.loss_tail`), the
rewrite calls :func:`lm_head_loss` (op ``chunked_logits::lm_head_loss``): per row chunk it
computes the logits, their per-row results, the tail's partial sums and cotangents, and the
chunk's gradients; the loss is the graph's own scalar part on the sums (accumulated in
FP64).  Each gradient element is one FP32 sum rounded once.  See NOTE [lm_head_loss plans].
"""

# NOTE [lm_head_loss plans]
# When a fused lm_head region's per-row results (lse, token log-prob, entropy) reach the
# graph's scalar loss only through row-local ops and sums / means over all rows combined
# affinely (:mod:`fx_passes.match.loss_tail`), each row's cotangent for a unit loss is known
# in the forward.  The rewrite then calls :func:`lm_head_loss`, which runs the custom op
# ``chunked_logits::lm_head_loss``: per row chunk (whole vocabulary)
#
# * the logits chunk in model precision, upcast, its per-row results;
# * the tail (the user's own ops, an FX graph ``tail(lse, logprob, entropy, *rows, *whole)``
#   returning the tensors the loss sums) on the chunk, compiled with its gradient: the
#   chunk's partial sums and, for a unit loss, the per-row cotangents of the results;
# * the model-precision logits gradient of the chunk from those cotangents, written over
#   the chunk's logits (one kernel reads each logit once and writes its gradient in its
#   place: one ``[r, V]`` tile a chunk, not two), then ``grad_hidden[chunk] = g @ W``: one
#   GEMM holding the whole sum over the vocabulary.
#
# ``grad_weight[v]`` sums over every row, so across chunks.  Each gradient element is one
# FP32 sum rounded to model precision once; how ``grad_weight`` keeps that depends on the
# plan (``tiling.backward_plan``):
#
# * ``"gpu"`` (``torch.mm/addmm(..., out_dtype=torch.float32)``): an FP32 ``[V, H]``
#   accumulator takes each chunk's ``g.t() @ h`` (model-precision inputs); the FP32
#   gradients are kept until the backward, which scales them by the incoming gradient and
#   rounds once: 3 GEMMs, exact for any incoming gradient, no host sync.
# * ``"two_sweeps"`` (CPUs with bf16/fp16 units): ``grad_hidden`` is rounded in the forward
#   and the per-row cotangents are kept; the backward runs one vocabulary sweep over all
#   rows for ``grad_weight`` (recomputing the logits): 4 GEMMs.  Scaling a rounded gradient
#   by ``g`` would round twice, so the forward's ``grad_hidden`` is used only when that
#   scaling is exact (``g`` read with ``.item()``, free on a CPU: 1, -1, any power of two, and
#   no scaled element rounded); otherwise the backward recomputes both gradients from the
#   cotangents times ``g`` (4 GEMMs more: 6 in all).  Forced on another device, it never
#   reads ``g`` (no host sync): it always recomputes.
#
# The loss is the graph's own scalar part (``final(*reductions, *whole)``) on the sums,
# each accumulated over the chunks in FP64.

from __future__ import annotations

from typing import Optional

import torch

from .. import rows as rows_of
from ..ops import user_bodies
from ..ops.args import (
    Cotangents,
    Head,
    HeadOptions,
    LogitMap,
    LossOptions,
    RowValues,
    grads_by_name,
)
from ..ops.body_compiler import compile_body
from ..ops.pair import call_by_name, save_inputs, saved_inputs
from ..ops.registry import CAPTURE_SAFE, emitted
from ..tiling import BY_DEVICE, even_splits, forward_rows, gpu_loss_rows, resolve_budget
from .bodies import grad_through_transforms, transformed
from .given import grad_of_logits, softmax_lse, stats_and_residual
from .gpu_plan import fp32_chunk_grads
from .lm_head_sweeps import lm_head_grads
from .loss_parts import final_loss, loss_of_sums, reductions_of, row_weights, scaled_exactly

__all__ = ["lm_head_loss", "PLANS", "COUNTER"]

# The plans that compute gradients in the forward (the others keep the recompute path).
PLANS = ("gpu", "two_sweeps")
COUNTER = "loss_tail_body_eager"
F32 = torch.float32


def stats_of_kept(x, tokens, scale, is_div: bool, want_entropy: bool, transforms: str):
    """(lse, logprob or None, entropy or None, lse's residual) of a chunk's model-precision
    logits ``x`` (before the transforms), which the caller's GEMM wrote where they are
    kept: the stats ``bodies.forward_chunk`` computes, without its GEMM (NOTE [kept logits])."""
    return stats_and_residual(transformed(x, transforms)[0], tokens, scale, is_div, want_entropy)


def logits_grad(x, tokens, saved: RowValues, grads: Cotangents, logit_map: LogitMap):
    """``bodies.backward_block``'s gradient from the chunk's logits ``x`` (no matmul)."""
    z, outs = transformed(x, logit_map.transforms)
    grad = grad_of_logits(z, tokens, saved.lse, saved.entropy, grads, logit_map.scale, logit_map.is_div,
                          saved.lse_lo)
    return grad_through_transforms(grad, outs, logit_map.transforms).to(x.dtype)


def logits_grad_into(x, tokens, saved: RowValues, grads: Cotangents, logit_map: LogitMap) -> None:
    """:func:`logits_grad` written over the chunk's logits ``x`` (which the loop owns):
    compiled, one kernel that reads each element of ``x`` once and writes its gradient in
    its place, no ``[r, V]`` temporary (tests/test_gpu_loss_chunks.py reads the code)."""
    x.copy_(logits_grad(x, tokens, saved, grads, logit_map))


# NOTE [a body that writes over its logits]
# The loss loop's chunk body reads its logits for the row stats and then writes their
# gradient over them, in one compiled function (one kernel).  The token's logit was a
# gather, an indirect load that Inductor may place where its value is first used: in the
# gradient's loop, after that loop has stored the gradient over some of the row.  Inductor
# of torch 2.11 did so in its C++ code, and the loss came out wrong (the cross-entropy of
# WV with ignored labels: 0.238 off, its gradients right; torch 2.13 orders the load
# first).  The body reads the token's logit in the row's reduction sweep instead (a sum
# whose one term is that logit: exact), which every version finishes before the gradient
# loop starts (its results feed it).  tests/test_loss_in_graph.py::
# test_the_token_logit_is_read_before_the_gradient_overwrites_it.  A row-local body's
# row sweep (``row_local.sweeps.stats_into``: the traced user body, its gradient written
# over the logits) had the same hazard, its token log-probs wrong on 2.11 where a result
# but not the gradient reads them: its gathers of one column a row are rewritten into the
# same one-term sums (``sweeps.picked_in_the_sweep``), and a graph with another indirect
# read of the logits writes its gradient beside them.  tests/test_row_local_sweeps.py::
# test_a_gathered_logit_is_read_before_the_gradient_overwrites_it.


def chunk_body(tail_key: str):
    """One row chunk's work after its logits' GEMM, compiled by Inductor once per loss tail
    (``tail_key``): ``(x, tokens, logit_map, want_entropy, log_softmax, *rows, *whole,
    *weights) -> (lse, entropy, lse's residual, g_lse, g_logprob, g_entropy, *sums)``, the stats, the
    tail's cotangents for a unit loss and its sums over the chunk, the logits gradient
    written over ``x``.  One compiled function, so Inductor fuses the row reductions with the
    gradient's pointwise loop: the logits are read in one kernel that also writes their
    gradient (on a CPU the tail's sums too; tests/test_gpu_loss_chunks.py reads the code).
    The backward's values: ``lse`` as it reads it (``given.softmax_lse``), None where the
    region has no such result."""
    tail = user_bodies.function(tail_key)

    def loss_chunk(x, tokens, logit_map: LogitMap, want_entropy: bool, log_softmax: bool, *rest):
        z = transformed(x, logit_map.transforms)[0]
        lse, lp, ent, lse_lo = stats_and_residual(z, tokens, logit_map.scale, logit_map.is_div, want_entropy,
                                                  picked_in_the_sweep=True)  # (NOTE [a body that writes ...])
        zeros = lse.new_zeros(lse.shape)
        lp_, ent_ = (v if v is not None else zeros for v in (lp, ent))
        c_lse, c_lp, c_ent, *part = tail(lse, lp_, ent_, *rest)
        lse = softmax_lse(lse, log_softmax)
        cot = Cotangents(c_lse, c_lp if tokens is not None else None, c_ent if want_entropy else None)
        logits_grad_into(x, tokens, RowValues(lse, ent, lse_lo), cot, logit_map)
        return (lse, ent, lse_lo, *cot, *part)
    return compile_body(("lm_head_loss_chunk", tail_key), loss_chunk, f"loss_chunk_{tail_key}", COUNTER,
                        {"emulate_precision_casts": True})


def _empty(like: torch.Tensor, dtype=F32) -> torch.Tensor:
    return like.new_empty(0, dtype=dtype)


def _forward(head: Head, opts: HeadOptions, loss: LossOptions, rows: list[torch.Tensor],
             whole: list[torch.Tensor]) -> tuple:
    """The op's results (:func:`_lm_head_loss`)."""
    n, dev = head.hidden.shape[0], head.hidden.device
    weights = row_weights(loss.final_key, loss.kinds, whole, n, dev)
    kept = _kept_rows(head, opts, loss.mask_key, rows, whole, weights)
    count = torch.full((), n if kept is None else kept.shape[0], dtype=torch.int64, device=dev)  # (no copy)
    index = torch.arange(n, device=dev) if kept is None else _first(kept, n)
    if kept is not None:  # the loop on the rows that count; the others' results are exact zeros
        head, rows = head.take(kept), [r[kept] for r in rows]
    value, gh, gw, gb, keep = _loop(head, opts, loss, rows, whole, weights, n)
    if kept is not None:
        if loss.need_hidden:
            gh = gh.new_zeros(n, gh.shape[1]).index_copy_(0, kept, gh)
        keep = [_first(k, n) for k in keep]
    return (value, gh, gw, gb, *keep[:5], index, count, keep[5])


def _first(values: torch.Tensor, n: int) -> torch.Tensor:
    """``values`` (one per kept row) in the first places of ``n`` (the backward's layout)."""
    if not values.numel():
        return values
    out = values.new_zeros(n)
    out[:values.shape[0]] = values
    return out


def _kept_rows(head: Head, opts: HeadOptions, mask_key: str, rows: list[torch.Tensor],
               whole: list[torch.Tensor], weights: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """The rows the loop must run (ascending), or None for all of them: those the loss
    tail's skip graph ``mask_key`` (``match/row_mask.py``) cannot prove exactly zero in
    value and gradient.  The ``"two_sweeps"`` backward reads the count from host memory:
    that plan compacts on CPUs only."""
    hidden, weight = head.hidden, head.weight
    if not mask_key or (opts.plan != "gpu" and hidden.device.type != "cpu"):
        return None
    z = rows_of.logit_bounds(hidden, weight, head.bias, head.scale, opts.scale_is_div, opts.transforms)
    skip = user_bodies.function(mask_key)(*rows_of.item_bounds(z, weight.shape[0]), *rows, *whole, *weights)
    return rows_of.select(skip.expand(hidden.shape[0]))


def _loop(head: Head, opts: HeadOptions, loss: LossOptions, rows: list[torch.Tensor],
          whole: list[torch.Tensor], weights: list[torch.Tensor], total: int) -> tuple:
    """The chunk loop over ``head``'s rows (``total``: every row's count, a mean's):
    (loss, grad_hidden, grad_weight, grad_bias, the per-row values the backward keeps)."""
    hidden, weight, bias = head.hidden, head.weight, head.bias
    n, width = hidden.shape
    vocab, dev = weight.shape[0], hidden.device
    budget_bytes = resolve_budget(opts.budget_bytes, dev)
    sums = [torch.zeros((), dtype=torch.float64, device=dev) for _ in reductions_of(loss.kinds)]
    gpu, need_hidden, need_weight = opts.plan == "gpu", loss.need_hidden, loss.need_weight
    gh = (hidden.new_empty(n, width, dtype=F32 if gpu else hidden.dtype) if need_hidden else _empty(hidden))
    # (the gpu plan's FP32 sums: written by the first chunk's GEMM, no zero-fill; gpu_plan.fp32_chunk_grads)
    gw = hidden.new_empty(vocab, width, dtype=F32) if gpu and need_weight else _empty(hidden)
    gb = hidden.new_empty(vocab, dtype=F32) if gpu and need_weight and bias is not None else _empty(hidden)
    keep = [hidden.new_zeros(n, dtype=F32) if not gpu else _empty(hidden) for _ in range(6)]
    log_softmax = head.tokens is not None or opts.want_entropy
    body = chunk_body(loss.tail_key)
    logit_map = opts.logit_map(hidden.dtype, head.scale)
    step = (gpu_loss_rows(budget_bytes, n, vocab, opts.budget_bytes == BY_DEVICE) if gpu
            else forward_rows(budget_bytes, n, vocab))
    chunks = even_splits(n, step)
    if not chunks:  # (no rows: zero sums)
        gw.zero_(), gb.zero_()
    for r0, r1 in chunks:
        chunk = head.rows(r0, r1)
        h, tok = chunk.hidden, chunk.tokens
        # g: the chunk's logits (a buffer of the loop's own), then their gradient in their place
        g = torch.mm(h, weight.t()) if bias is None else torch.addmm(bias, h, weight.t())
        lse, ent, lse_lo, *cot_part = body(g, tok, logit_map, opts.want_entropy, log_softmax,
                                           *(r[r0:r1] for r in rows), *whole, *weights)
        cot, part = cot_part[:3], cot_part[3:]
        if gpu:
            fp32_chunk_grads(g, h, weight, gh[r0:r1] if need_hidden else None, gw if need_weight else None,
                             gb if need_weight and bias is not None else None, r0 == 0, budget_bytes)
        else:
            if need_hidden:
                torch.mm(g, weight, out=gh[r0:r1])
            for buf, value in zip(keep, (lse, ent, *cot, lse_lo)):
                if value is not None:
                    buf[r0:r1] = value
        for s, p in zip(sums, part):  # (after the GEMMs: nothing between the gradient and them)
            s += p.double()
        del g
    return loss_of_sums(loss.final_key, loss.kinds, sums, total, whole), gh, gw, gb, keep


@torch.library.custom_op("chunked_logits::lm_head_loss", mutates_args=())
def _lm_head_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  tokens: Optional[torch.Tensor], scale: Optional[torch.Tensor], scale_is_div: bool,
                  want_entropy: bool, budget_bytes: int, transforms: str, plan: str, tail_key: str,
                  final_key: str, kinds: str, need_hidden: bool, need_weight: bool, rows: list[torch.Tensor],
                  whole: list[torch.Tensor], mask_key: str) -> tuple[
                      torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                      torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad_hidden, grad_weight, grad_bias, lse, entropy, g_lse, g_logprob, g_entropy,
    rows, count, lse's residual): ``"gpu"``: the gradients in FP32, the per-row values empty;
    ``"two_sweeps"``: ``grad_hidden`` in model precision, no weight gradients, the per-row
    values the backward's sweep reads (of the rows run: ``rows[:count]``, ``count`` 0-d;
    ``mask_key``: the skip graph, "" for none)."""
    return _forward(Head(hidden, weight, bias, tokens, scale),
                    HeadOptions(scale_is_div, want_entropy, budget_bytes, transforms, plan),
                    LossOptions(tail_key, final_key, kinds, need_hidden, need_weight, mask_key), rows, whole)


@_lm_head_loss.register_fake
def _(hidden, weight, bias, tokens, scale, scale_is_div, want_entropy, budget_bytes, transforms, plan,
      tail_key, final_key, kinds, need_hidden, need_weight, rows, whole, mask_key):
    return _fake(hidden, weight, bias, plan == "gpu", LossOptions(tail_key, final_key, kinds, need_hidden,
                                                                  need_weight, mask_key), whole)


def _fake(hidden, weight, bias, gpu: bool, loss: LossOptions, whole) -> tuple:
    """The op's results' metadata (:func:`_lm_head_loss`; ``gpu``: the plan)."""
    (n, width), vocab = hidden.shape, weight.shape[0]
    at = [torch.zeros((), dtype=dt, device=hidden.device) for _, dt in reductions_of(loss.kinds)]
    value = final_loss(loss.final_key, at, whole)
    gh = (hidden.new_empty(n, width, dtype=F32 if gpu else hidden.dtype) if loss.need_hidden
          else _empty(hidden))
    want_w = gpu and loss.need_weight
    gw = hidden.new_empty(vocab, width, dtype=F32) if want_w else _empty(hidden)
    gb = hidden.new_empty(vocab, dtype=F32) if want_w and bias is not None else _empty(hidden)
    keep = [hidden.new_empty(n, dtype=F32) if not gpu else _empty(hidden) for _ in range(6)]
    return (torch.empty_like(value), gh, gw, gb, *keep[:5], hidden.new_empty(n, dtype=torch.int64),
            hidden.new_empty((), dtype=torch.int64), keep[5])


@torch.library.custom_op("chunked_logits::lm_head_loss_backward", mutates_args=())
def _lm_head_loss_backward(g: torch.Tensor, grad_hidden: torch.Tensor, hidden: torch.Tensor,
                           weight: torch.Tensor, bias: Optional[torch.Tensor], tokens: Optional[torch.Tensor],
                           scale: Optional[torch.Tensor], scale_is_div: bool, budget_bytes: int,
                           transforms: str, lse: torch.Tensor, entropy: Optional[torch.Tensor],
                           c_lse: torch.Tensor, c_lp: torch.Tensor, c_ent: torch.Tensor,
                           need_hidden: bool, need_weight: bool, index: torch.Tensor,
                           count: torch.Tensor, lse_lo: Optional[torch.Tensor] = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``"two_sweeps"`` backward: the forward's ``grad_hidden`` times ``g`` and one
    vocabulary sweep for ``grad_weight`` from the cotangents times ``g`` when that scaling is
    exact (``g`` a power of two, 1 and -1 included, and no scaled element rounded: a
    gradient-accumulation ``loss / 4`` keeps 4 GEMMs), else both recomputed from the
    cotangents times ``g`` (each still one FP32 sum rounded once).  On a CPU, over the rows
    the forward ran (``index[:count]``, the others' gradients exact zeros)."""
    opts = HeadOptions(scale_is_div, entropy is not None, budget_bytes, transforms, "two_sweeps")
    return _sweeps_backward(g, grad_hidden, Head(hidden, weight, bias, tokens, scale),
                            RowValues(lse, entropy, lse_lo), Cotangents(c_lse, c_lp, c_ent), opts,
                            (need_hidden, need_weight), (index, count))


def _sweeps_backward(g: torch.Tensor, grad_hidden: torch.Tensor, head: Head, saved: RowValues,
                     grads: Cotangents, opts: HeadOptions, need: tuple[bool, bool],
                     kept: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """:func:`_lm_head_loss_backward` (``need``: (hidden, weight) gradients wanted; ``kept``:
    (index, count) of the rows the forward ran)."""
    hidden, (need_hidden, need_weight), (index, count) = head.hidden, need, kept
    if head.tokens is None:
        lse = saved.lse
        head = head._replace(tokens=torch.zeros(lse.shape, dtype=torch.long, device=lse.device))
    if g.device.type == "cpu" and int(count) < hidden.shape[0]:
        k = int(count)
        rows = index[:k]
        gh, gw, gb = _sweeps_backward(g, grad_hidden, head.take(rows), saved.rows(0, k), grads.rows(0, k),
                                      opts, need, (rows, count))
        return (gh if not need_hidden or gh.shape[0] == hidden.shape[0]
                else gh.new_zeros(hidden.shape).index_copy_(0, rows, gh)), gw, gb
    if g.device.type != "cpu":  # (a CPU plan elsewhere: no host read of g, both gradients recomputed)
        return lm_head_grads(head, saved, grads.times(g), opts, None, need_hidden, need_weight)
    scale_g = g.item()
    grads = grads.times(scale_g)
    gh = scaled_exactly(grad_hidden, scale_g) if need_hidden else _empty(hidden, hidden.dtype)
    if gh is not None:
        _, gw, gb = lm_head_grads(head, saved, grads, opts, None, False, need_weight)
        return gh, gw, gb
    return lm_head_grads(head, saved, grads, opts, None, need_hidden, need_weight)


@_lm_head_loss_backward.register_fake
def _(g, grad_hidden, hidden, weight, bias, tokens, scale, scale_is_div, budget_bytes, transforms, lse,
      entropy, c_lse, c_lp, c_ent, need_hidden, need_weight, index, count, lse_lo=None):
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0),
            weight.new_empty(weight.shape[0] if bias is not None and need_weight else 0))


# the forward's results past the loss, saved for the backward (its inputs of these names)
_MADE = ("grad_hidden", "grad_weight", "grad_bias", "lse", "entropy", "c_lse", "c_lp", "c_ent", "index",
         "count", "lse_lo")


def _setup(ctx, inputs, output):
    save_inputs(ctx, _lm_head_loss, inputs, extra=output[1:], names=Head._fields)


def _backward(ctx, g, *_):
    args, made = saved_inputs(ctx)
    made = dict(zip(_MADE, made))
    hidden, weight, bias = args["hidden"], args["weight"], args["bias"]
    g = g if g is not None else torch.zeros((), dtype=F32, device=hidden.device)
    want_h, want_w, want_b = ctx.needs_input_grad[:3]
    if args["plan"] == "gpu":  # FP32 gradients times g, rounded once
        gh = (made["grad_hidden"] * g).to(hidden.dtype) if args["need_hidden"] else None
        gw = (made["grad_weight"] * g).to(weight.dtype) if args["need_weight"] else None
        gb = (made["grad_bias"] * g).to(bias.dtype) if args["need_weight"] and bias is not None else None
    else:
        made["entropy"] = made["entropy"] if args["want_entropy"] else None
        gh, gw, gb = call_by_name(_lm_head_loss_backward, args, g=g, **made)
    return grads_by_name(_lm_head_loss, ctx.lengths, hidden=gh if want_h else None,
                         weight=gw if want_w else None, bias=gb if want_b and bias is not None else None)


_lm_head_loss.register_autograd(_backward, setup_context=_setup)


@emitted(("lm_head_loss", "lm_head_loss_backward"), CAPTURE_SAFE)
def lm_head_loss(hidden, weight, bias, tokens, scale, scale_is_div: bool, want_entropy: bool,
                 budget_bytes: int, transforms: str, plan: str, tail_key: str, final_key: str, kinds: str,
                 need_hidden: bool, need_weight: bool, n_rows: int, *operands, mask_key: str = ""):
    """Called from rewritten graphs: the graph's scalar loss of a fused lm_head region and
    its tail (:mod:`fx_passes.rewrite.loss_tail`).  ``hidden`` is ``[.., H]`` (its leading
    dims are the rows); ``operands``: the tail's ``n_rows`` per-row tensors (one value per
    row), then the tensors and numbers it reads whole; ``kinds``: each reduction's kind
    and dtype; ``plan``: ``"gpu"`` or ``"two_sweeps"`` (resolved by the rewrite);
    ``mask_key``: the tail's skip graph (:mod:`fx_passes.match.row_mask`), "" for none."""
    rows = [o.reshape(-1) for o in operands[:n_rows]]
    whole = [o if isinstance(o, torch.Tensor) else torch.scalar_tensor(
        o, dtype=F32 if isinstance(o, (float, torch.SymFloat)) else torch.int64, device=hidden.device)
        for o in operands[n_rows:]]
    return _lm_head_loss(*Head.flat(hidden, weight, bias, tokens, scale), scale_is_div, want_entropy,
                         budget_bytes, transforms, plan, tail_key, final_key, kinds, need_hidden, need_weight,
                         rows, whole, mask_key)[0]
