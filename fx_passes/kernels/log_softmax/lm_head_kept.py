"""The lm_head's ``"kept_logits"`` plan: the forward keeps its model-precision logits for the
backward, which then runs three GEMMs a step, not four.  See NOTE [kept logits].
"""

# NOTE [kept logits]
# The per-token lm_head loop (:mod:`.lm_head`) keeps only per-row results, so its backward
# recomputes the logits: four ``[T, H] x [H, V]`` GEMMs a step against stock's three (the
# H200 run of 2026-12-04: 1.36x stock's step for per-token log-probs, docs/gpu.md).  With
# ``lm_head_plan="kept_logits"`` (a user's choice; ``auto`` never picks it) the forward's
# row chunks write their model-precision logits into one ``[N, V]`` buffer, as stock's
# GEMM writes its logits, and the backward reads them instead of recomputing:
#
# * forward (op ``chunked_logits::lm_head_stats_kept``): per row chunk the logits GEMM
#   into the kept buffer and the chunk's per-row results from those values
#   (``loss.logits_and_stats``: the same maths as the recomputing loop's chunk);
# * backward (op ``chunked_logits::lm_head_kept_backward``): per row chunk of the kept
#   logits (``tiling.gpu_loss_rows``: at most ``MAX_LOSS_CHUNKS`` with the device's
#   budget) one row kernel forms the model-precision gradient tile from the saved lse and
#   the incoming per-row gradients (``loss.logits_grad``: out of place, the kept logits are
#   only read, so a retained graph's second backward reads them unchanged), then
#   ``grad_hidden[chunk] = g @ W`` (one GEMM, the whole sum over the vocabulary inside it,
#   rounded once) and ``grad_weight`` summed across the chunks in an FP32 ``[V, H]``
#   buffer that the first chunk's GEMM writes and every later one adds to inside the GEMM
#   (``gpu_plan.fp32_chunk_grads``), rounded once at the end.
#
# Each gradient element is one FP32 sum rounded once, as in every plan.  The price is the
# memory: the ``2 N V`` bytes of the logits from the forward to the backward (stock keeps
# them too; a log-prob's stock also keeps an FP32 ``[N, V]``), a gradient tile and the FP32
# ``[V, H]`` sum in the backward.  It needs ``out_dtype`` GEMMs (``tiling.backward_plan``:
# elsewhere the device's own plan runs, logged).  Logits the graph returns are never kept
# (the caller may change them in place: ``lm_head_stats_logits`` recomputes), and the
# masked, loss-in-graph, row-local and vocab-parallel loops run ``"gpu"``.

from __future__ import annotations

from typing import Optional

import torch

from ... import compat
from ..ops.args import Cotangents, Head, HeadOptions, RowValues, args_by_name, grads_by_name
from ..ops.pair import call_by_name, save_inputs, saved_inputs
from ..tiling import BY_DEVICE, backward_plan, even_splits, gpu_loss_rows, resolve_budget
from .bodies import compiled
from .given import softmax_lse
from .gpu_plan import fp32_chunk_grads
from .loss import logits_and_stats, logits_grad

__all__ = ["KEPT", "lm_head_stats_kept", "lm_head_kept_backward", "kept_grads", "keeps_logits",
           "per_row_inputs"]

KEPT = "kept_logits"
F32 = torch.float32


@torch.library.custom_op("chunked_logits::lm_head_stats_kept", mutates_args=())
def lm_head_stats_kept(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       tokens: Optional[torch.Tensor], scale: Optional[torch.Tensor], scale_is_div: bool,
                       want_entropy: bool, budget_bytes: int, transforms: str,
                       plan: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lm_head_stats``'s per-row results and the model-precision logits ``[N, V]`` (before
    the transforms), which only its backward reads."""
    from .lm_head import _forward_loop  # (lm_head imports this module)

    logits = hidden.new_empty(hidden.shape[0], weight.shape[0])
    stats = _forward_loop(Head(hidden, weight, bias, tokens, scale),
                          HeadOptions(scale_is_div, want_entropy, budget_bytes, transforms, plan), logits,
                          body=logits_and_stats)
    return (*stats, logits)


@lm_head_stats_kept.register_fake
def _(hidden, weight, bias, tokens, scale, scale_is_div, want_entropy, budget_bytes, transforms, plan):
    backward_plan(hidden.device, hidden.dtype, plan)  # (its one-time probe at compile time, not in a step)
    n = hidden.shape[0]
    return (*(hidden.new_empty(n, dtype=F32) for _ in range(3)), hidden.new_empty(n, weight.shape[0]))


@torch.library.custom_op("chunked_logits::lm_head_kept_backward", mutates_args=())
def lm_head_kept_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          tokens: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor,
                          entropy: Optional[torch.Tensor], g_lse: torch.Tensor, g_logprob: torch.Tensor,
                          g_entropy: torch.Tensor, scale: Optional[torch.Tensor], scale_is_div: bool,
                          budget_bytes: int, transforms: str, need_hidden: bool = True,
                          need_weight: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return kept_grads(Head(hidden, weight, bias, tokens, scale), logits, RowValues(lse, entropy),
                      Cotangents(g_lse, g_logprob, g_entropy),
                      HeadOptions(scale_is_div, entropy is not None, budget_bytes, transforms, KEPT),
                      need_hidden, need_weight)


@lm_head_kept_backward.register_fake
def _(hidden, weight, bias, tokens, logits, lse, entropy, g_lse, g_logprob, g_entropy, scale, scale_is_div,
      budget_bytes, transforms, need_hidden=True, need_weight=True):
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0),
            weight.new_empty(weight.shape[0] if bias is not None and need_weight else 0))


def kept_grads(head: Head, logits: torch.Tensor, saved: RowValues, grads: Cotangents, opts: HeadOptions,
               need_hidden: bool = True, need_weight: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``hidden``, ``weight`` and ``bias`` from the kept model-precision
    ``logits`` (NOTE [kept logits]); an empty tensor for one not needed (``need_weight``
    covers the bias).  ``head.tokens``: zeros where the forward had none; ``grads``: each a
    tensor (zeros for none flowing)."""
    hidden, weight, bias = head.hidden, head.weight, head.bias
    (n, width), vocab, dev = hidden.shape, weight.shape[0], hidden.device
    budget_bytes = resolve_budget(opts.budget_bytes, dev)
    grad_hidden = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    with_bias = bias is not None and need_weight
    # the FP32 sums over the rows: written by the first chunk's GEMM, added to by the others
    acc_w = hidden.new_empty(vocab, width, dtype=F32) if need_weight else None
    acc_b = hidden.new_empty(vocab, dtype=F32) if with_bias else None
    body, logit_map = compiled(logits_grad), opts.logit_map(hidden.dtype, head.scale)
    chunks = even_splits(n, gpu_loss_rows(budget_bytes, n, vocab, opts.budget_bytes == BY_DEVICE))
    for r0, r1 in chunks:
        g = body(logits[r0:r1], head.tokens[r0:r1], saved.rows(r0, r1), grads.rows(r0, r1), logit_map)
        if need_hidden:
            torch.mm(g, weight, out=grad_hidden[r0:r1])
        fp32_chunk_grads(g, hidden[r0:r1], weight, None, acc_w, acc_b, r0 == 0, budget_bytes)
        del g  # (before the next chunk's tile exists)
    for acc in (acc_w, acc_b) if not chunks else ():  # (no rows: zero sums)
        if acc is not None:
            acc.zero_()
    grad_weight = acc_w.to(weight.dtype) if acc_w is not None else weight.new_empty(0)
    del acc_w
    grad_bias = acc_b.to(weight.dtype) if acc_b is not None else weight.new_empty(0)
    return grad_hidden, grad_weight, grad_bias


def per_row_inputs(tokens: Optional[torch.Tensor], lse: torch.Tensor, entropy: Optional[torch.Tensor],
                   g_lse, g_logprob, g_entropy) -> dict[str, torch.Tensor]:
    """A per-token backward op's per-row arguments: ``tokens`` (zeros where the forward had
    none), the softmax's lse and each incoming gradient (zeros for one that does not flow
    or whose result the forward did not compute)."""
    zeros = lse.new_zeros(lse.shape)
    return {"tokens": tokens if tokens is not None else torch.zeros(lse.shape, dtype=torch.long,
                                                                     device=lse.device),
            "lse": softmax_lse(lse, log_softmax=tokens is not None or entropy is not None),
            "g_lse": g_lse if g_lse is not None else zeros,
            "g_logprob": g_logprob if (g_logprob is not None and tokens is not None) else zeros,
            "g_entropy": g_entropy if (g_entropy is not None and entropy is not None) else zeros}


def _setup(ctx, inputs, output):
    lse, _, entropy, logits = output
    want_entropy = args_by_name(lm_head_stats_kept, inputs)["want_entropy"]
    save_inputs(ctx, lm_head_stats_kept, inputs, extra=(lse, entropy if want_entropy else None, logits))


def _backward(ctx, g_lse, g_logprob, g_entropy, g_logits=None):
    """``g_logits``: the kept logits' gradient, which nothing reads (the caller never sees
    them): not used."""
    args, (lse, entropy, logits) = saved_inputs(ctx)
    bias = args["bias"]
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    gh, gw, gb = call_by_name(lm_head_kept_backward, args, logits=logits, entropy=entropy,
                              **per_row_inputs(args["tokens"], lse, entropy, g_lse, g_logprob, g_entropy),
                              need_hidden=need_hidden, need_weight=need_weight or need_bias)
    return grads_by_name(lm_head_stats_kept, {}, hidden=gh if need_hidden else None,
                         weight=gw if need_weight else None,
                         bias=gb if bias is not None and need_bias else None)


lm_head_stats_kept.register_autograd(_backward, setup_context=_setup)


def keeps_logits(hidden: torch.Tensor, weight: torch.Tensor, plan: str) -> bool:
    """Does the per-token loop keep its logits: ``plan`` resolves to ``"kept_logits"`` on
    ``hidden``'s device (``tiling.backward_plan``) and a backward may read them (a graph
    without one keeps nothing)?  Asked while the graph is traced: reads the dispatch table
    only (the op's fake kernel runs the device's one-time probe)."""
    wanted = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return plan == KEPT and wanted and compat.gemm_out_dtype(hidden.device.type)
