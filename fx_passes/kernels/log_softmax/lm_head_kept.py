"""The lm_head's ``"kept_logits"`` plan: the per-token forward keeps its model-precision
logits for the backward, which writes their gradient in their place and runs stock's two
gradient GEMMs: three GEMMs a step, not four.  See NOTE [kept logits].
"""

# NOTE [kept logits]
# The per-token lm_head loop (:mod:`.lm_head`) keeps only per-row results, so its backward
# recomputes the logits: four ``[T, H] x [H, V]`` GEMMs a step against stock's three (the
# H200 run of 2026-12-04: 1.36x stock's step for per-token log-probs, docs/gpu.md).  With
# ``lm_head_plan="kept_logits"``, or ``"auto"`` on a GPU where stock keeps an FP32 ``[T, V]``
# and no mask leaves rows out (``tiling.keeps_logits``, NOTE [lm_head backward plans]), a
# per-token call that returns no logits runs :func:`lm_head_row_stats_kept` instead (``pipeline``: after
# the masked-row rewrite, which keeps its own loop; a loss in the graph is not rewritten
# into the gradients-in-the-forward loop, ``rewrite/loss_tail._plan``, but stays in the
# graph on this call: three GEMMs there too, no FP32 ``[V, H]`` sum; the vocab-parallel
# one-pass loop's counterpart: NOTE [kept shard logits] in ``distributed/kept_stages.py``):
#
# * forward (op ``chunked_logits::lm_head_stats_kept``): per row chunk the logits GEMM
#   writes its rows of one model-precision ``[N, V]`` buffer (``out=``, no copy), as stock's
#   GEMM writes its logits, and one compiled body reads those values for the chunk's per-row
#   results (``loss.stats_of_kept``: the recomputing loop's maths); no FP32 ``[N, V]``.
# * the chunks (``tiling.kept_rows``): on a GPU with the device's budget one, all rows: the
#   logits GEMM is stock's own and each body one row kernel over the kept buffer, which a
#   chunk adds nothing to; on a CPU, with a budget the user set, or with a soft cap (whose
#   tanh Inductor keeps in an FP32 tile), ``forward_rows``.
# * backward (op ``chunked_logits::lm_head_kept_backward``): per row chunk one kernel reads
#   the kept logits and writes their model-precision gradient in their place
#   (``loss.logits_grad_into``), then ``grad_hidden = g @ W`` and ``grad_weight = g.T @ h``
#   are one GEMM each over all rows, each gradient element one FP32 sum inside its GEMM,
#   rounded once: stock's GEMMs on stock's buffer, no FP32 ``[V, H]`` or ``[T, H]`` sum.
#
# Its memory is stock's cross-entropy's (``2 N V`` bytes from the forward to the backward,
# the gradient in their place): under stock's for a log-prob (whose stock also keeps an FP32
# ``[N, V]``), equal to it for a cross-entropy alone, above the recomputing plans' (which
# hold a chunk).  A graph without a backward (``no_grad`` scoring) keeps nothing.
#
# A second backward through the same forward (``retain_graph=True``) finds the forward's
# host flag cleared by the first and recomputes the logits (the same compiled chunks, the
# same values) before it starts, as NOTE [retained graph] in ``row_local/head.py``; both
# ops carry ``torch.Tag.cudagraph_unsafe`` (``mode="reduce-overhead"`` runs them outside
# the captured partitions).

from __future__ import annotations

from typing import Optional

import torch

from ..ops.args import Cotangents, Head, HeadOptions, RowValues, args_by_name, grads_by_name
from ..ops.pair import call_by_name, save_inputs, saved_inputs
from ..ops.registry import CUDAGRAPH_UNSAFE, UNSAFE, emitted
from ..tiling import BY_DEVICE, even_splits, kept_rows, resolve_budget
from .bodies import compiled
from .given import per_row_inputs
from .lm_head import _shaped, _store, lm_head_row_stats
from .loss import logits_grad_into, stats_of_kept

__all__ = ["KEPT", "lm_head_stats_kept", "lm_head_kept_backward", "kept_grads", "lm_head_row_stats_kept"]

KEPT = "kept_logits"
F32 = torch.float32


def _host_flag(flag: torch.Tensor) -> bool:
    """The flag's value, read from host memory (no device sync)."""
    assert flag.device.type == "cpu", flag.device
    return bool(flag.tolist()[0])


def _chunks(hidden: torch.Tensor, vocab: int, opts: HeadOptions) -> list[tuple[int, int]]:
    """The row chunks of both loops (``tiling.kept_rows``: one on a GPU with its budget)."""
    n = hidden.shape[0]
    rows = kept_rows(resolve_budget(opts.budget_bytes, hidden.device), n, vocab, hidden.device.type,
                     opts.budget_bytes == BY_DEVICE, opts.transforms)
    return even_splits(n, rows)


def _fill(head: Head, opts: HeadOptions, logits: torch.Tensor):
    """The forward's loop writing ``logits``; its per-row results.  Per chunk the logits
    GEMM writes its rows of the kept buffer (``out=``: stock's GEMM, no copy), then one
    compiled body reads them for the chunk's stats (``loss.stats_of_kept``)."""
    hidden, weight, bias = head.hidden, head.weight, head.bias
    n = hidden.shape[0]
    lse, logprob, entropy, lse_lo = (hidden.new_zeros(n, dtype=F32) for _ in range(4))
    body = compiled(stats_of_kept)
    for r0, r1 in _chunks(hidden, weight.shape[0], opts):
        chunk, x = head.rows(r0, r1), logits[r0:r1]
        if bias is None:
            torch.mm(chunk.hidden, weight.t(), out=x)
        else:
            torch.addmm(bias, chunk.hidden, weight.t(), out=x)
        _store((lse, logprob, entropy, lse_lo), r0, r1,
               body(x, chunk.tokens, head.scale, opts.scale_is_div, opts.want_entropy, opts.transforms))
    return lse, logprob, entropy, lse_lo


@torch.library.custom_op("chunked_logits::lm_head_stats_kept", mutates_args=(), tags=UNSAFE)
def lm_head_stats_kept(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       tokens: Optional[torch.Tensor], scale: Optional[torch.Tensor], scale_is_div: bool,
                       want_entropy: bool, budget_bytes: int, transforms: str,
                       plan: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                  torch.Tensor]:
    """``lm_head_stats``' per-row results, the model-precision logits ``[N, V]`` (before the
    transforms) that only its backward reads, a host flag: 1 until a backward writes
    the logits' gradient over them, and lse's residual (for the backward only)."""
    logits = hidden.new_empty(hidden.shape[0], weight.shape[0])
    lse, logprob, entropy, lse_lo = _fill(Head(hidden, weight, bias, tokens, scale),
                                          HeadOptions(scale_is_div, want_entropy, budget_bytes, transforms,
                                                      plan), logits)
    return lse, logprob, entropy, logits, torch.ones(1, dtype=torch.uint8), lse_lo


@lm_head_stats_kept.register_fake
def _(hidden, weight, bias, tokens, scale, scale_is_div, want_entropy, budget_bytes, transforms, plan):
    n = hidden.shape[0]
    return (*(hidden.new_empty(n, dtype=F32) for _ in range(3)), hidden.new_empty(n, weight.shape[0]),
            torch.empty(1, dtype=torch.uint8), hidden.new_empty(n, dtype=F32))


@torch.library.custom_op("chunked_logits::lm_head_kept_backward", mutates_args=(), tags=UNSAFE)
def lm_head_kept_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          tokens: torch.Tensor, logits: torch.Tensor, flag: torch.Tensor, lse: torch.Tensor,
                          entropy: Optional[torch.Tensor], g_lse: torch.Tensor, g_logprob: torch.Tensor,
                          g_entropy: torch.Tensor, scale: Optional[torch.Tensor], scale_is_div: bool,
                          budget_bytes: int, transforms: str, need_hidden: bool = True,
                          need_weight: bool = True, lse_lo: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # ``logits`` (which this call's forward made and only it reads) and ``flag`` are
    # written in place: no graph value reads them after this op (their version counters
    # are kept: autograd checks them when a retained graph's backward unpacks them again,
    # and the flag makes that second backward correct).
    keep = torch.autograd._unsafe_preserve_version_counter
    head = Head(hidden, weight, bias, tokens, scale)
    opts = HeadOptions(scale_is_div, entropy is not None, budget_bytes, transforms, KEPT)
    with keep(logits), keep(flag):
        if not _host_flag(flag):  # a second backward: the first wrote the gradient over the logits
            _fill(head, opts, logits)
        saved, grads = RowValues(lse, entropy, lse_lo), Cotangents(g_lse, g_logprob, g_entropy)
        got = kept_grads(head, logits, saved, grads, opts, need_hidden, need_weight)
        flag.zero_()
    return got


@lm_head_kept_backward.register_fake
def _(hidden, weight, bias, tokens, logits, flag, lse, entropy, g_lse, g_logprob, g_entropy, scale,
      scale_is_div, budget_bytes, transforms, need_hidden=True, need_weight=True, lse_lo=None):
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0),
            weight.new_empty(weight.shape[0] if bias is not None and need_weight else 0))


def kept_grads(head: Head, logits: torch.Tensor, saved: RowValues, grads: Cotangents, opts: HeadOptions,
               need_hidden: bool = True, need_weight: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``hidden``, ``weight`` and ``bias`` from the kept model-precision
    ``logits``, whose gradient it writes in their place (NOTE [kept logits]); an empty
    tensor for one not needed (``need_weight`` covers the bias).  ``head.tokens``: zeros
    where the forward had none; ``grads``: each a tensor (zeros for none flowing)."""
    hidden, weight, bias = head.hidden, head.weight, head.bias
    vocab = weight.shape[0]
    body, logit_map = compiled(logits_grad_into), opts.logit_map(hidden.dtype, head.scale)
    for r0, r1 in _chunks(hidden, vocab, opts):
        body(logits[r0:r1], head.tokens[r0:r1], saved.rows(r0, r1), grads.rows(r0, r1), logit_map)
    g = logits  # the logits' gradient, model precision, where they were
    grad_hidden = torch.mm(g, weight) if need_hidden else hidden.new_empty(0)
    grad_weight = torch.mm(g.t(), hidden) if need_weight else weight.new_empty(0)
    with_bias = bias is not None and need_weight
    grad_bias = g.sum(0, dtype=F32).to(weight.dtype) if with_bias else weight.new_empty(0)
    return grad_hidden, grad_weight, grad_bias


def _setup(ctx, inputs, output):
    lse, _, entropy, logits, flag, lse_lo = output
    want_entropy = args_by_name(lm_head_stats_kept, inputs)["want_entropy"]
    save_inputs(ctx, lm_head_stats_kept, inputs,
                extra=(lse, entropy if want_entropy else None, logits, flag, lse_lo))


def _backward(ctx, g_lse, g_logprob, g_entropy, g_logits=None, g_flag=None, g_lse_lo=None):
    """``g_logits``, ``g_flag``, ``g_lse_lo``: of the kept logits, the flag and lse's
    residual, which nothing reads (the caller never sees them): not used."""
    args, (lse, entropy, logits, flag, lse_lo) = saved_inputs(ctx)
    bias = args["bias"]
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    gh, gw, gb = call_by_name(lm_head_kept_backward, args, logits=logits, flag=flag, entropy=entropy,
                              lse_lo=lse_lo,
                              **per_row_inputs(args["tokens"], lse, entropy, g_lse, g_logprob, g_entropy),
                              need_hidden=need_hidden, need_weight=need_weight or need_bias)
    return grads_by_name(lm_head_stats_kept, {}, hidden=gh if need_hidden else None,
                         weight=gw if need_weight else None,
                         bias=gb if bias is not None and need_bias else None)


lm_head_stats_kept.register_autograd(_backward, setup_context=_setup)


@emitted(("lm_head_stats_kept", "lm_head_kept_backward"), CUDAGRAPH_UNSAFE)
def lm_head_row_stats_kept(hidden, weight, bias, tokens, scale, scale_is_div: bool, want_entropy: bool,
                           budget_bytes: int, transforms: str = "", plan: str = KEPT):
    """``lm_head_row_stats`` (no logits returned) keeping the logits for the backward
    (NOTE [kept logits]); where no backward may read them (grad mode off, or neither
    ``hidden`` nor ``weight`` requiring grad) it is ``lm_head_row_stats`` itself."""
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return lm_head_row_stats(hidden, weight, bias, tokens, scale, scale_is_div, want_entropy,
                                 budget_bytes, transforms, plan)
    flat = (*Head.flat(hidden, weight, bias, tokens, scale), scale_is_div, want_entropy, budget_bytes,
            transforms, plan)
    return _shaped(lm_head_stats_kept(*flat)[:3], hidden.shape[:-1], tokens is not None, want_entropy, None)
