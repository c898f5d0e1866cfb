"""lm_head inside the chunk: never materialise the logits when a matmul makes them.

When a region's logits are ``hidden @ weight.T`` in the same graph and nothing else reads
them (:mod:`fx_passes.match.lm_head`), the rewrite calls :func:`lm_head_row_stats` (op
``chunked_logits::lm_head_stats``; ``lm_head_stats_logits`` when the graph returns the logits
too): a loop over row chunks that keeps only per-row results, and a backward that recomputes
the logits tile by tile (:mod:`.lm_head_sweeps`).  Each gradient element is one FP32 sum
stored in model precision once; no FP32 ``[V, H]`` or ``[T, H]`` buffer exists.  The same loop
on the rows a mask leaves in: :mod:`.lm_head_masked`.  See NOTE [lm_head loop].
"""

# NOTE [lm_head loop]
# When a region's logits are ``hidden @ weight.T`` in the same graph and nothing else
# reads them (:mod:`fx_passes.match.lm_head`), the rewrite calls
# :func:`lm_head_row_stats`, which runs the custom op ``chunked_logits::lm_head_stats``:
#
# * forward: a loop over row chunks; per chunk the logits chunk is computed in model
#   precision, upcast, scaled in FP32 and reduced; only per-row results are kept.
# * backward: the logits are recomputed tile by tile and the pointwise gradient is
#   formed from the saved lse (and entropy) (:mod:`.lm_head_sweeps`).  Each element of ``grad_weight`` and of
#   ``grad_hidden`` is accumulated in FP32 and stored in model precision once: no FP32
#   ``[V, H]`` or ``[T, H]`` buffer exists, and nothing is accumulated in bf16.  How
#   the tiles are ordered depends on the CPU or GPU (``tiling.backward_plan``): on a CPU
#   with bf16 units, a sweep over row chunks (whole vocabulary) writes ``grad_hidden``
#   and a sweep over vocabulary blocks (all rows) writes ``grad_weight``, with
#   model-precision matmuls only; elsewhere one sweep over vocabulary blocks writes
#   ``grad_weight[block]`` and accumulates ``grad_hidden`` for a bounded group of rows
#   (on GPUs with GEMMs of model-precision inputs and an FP32 output:
#   :mod:`fx_passes.kernels.log_softmax.gpu_plan`).
#   A gradient nothing asks for (a frozen lm_head weight) is not computed.
#
# When the graph returns the logits too, ``chunked_logits::lm_head_stats_logits`` runs the
# same loop and also writes each chunk's logits into the returned tensor; its backward
# adds that output's gradient tile by tile (no ``[T, V]`` gradient is formed).
#
# Sizes come from :mod:`fx_passes.kernels.tiling`; the per-chunk bodies are compiled by
# Inductor (:mod:`fx_passes.kernels.log_softmax.bodies`).  The loops run in Python, which is why the op is
# opaque to the outer graph.

from __future__ import annotations

from typing import Optional

import torch

from ..ops.args import Cotangents, Head, HeadOptions, RowValues, args_by_name, grads_by_name
from ..ops.pair import call_by_name, save_inputs, saved_inputs
from ..ops.registry import CAPTURE_SAFE, emitted
from ..tiling import backward_plan, forward_rows, resolve_budget
from .bodies import compiled, forward_chunk, forward_chunk_logits
from .given import per_row_inputs
from .lm_head_sweeps import lm_head_grads

__all__ = ["lm_head_row_stats", "lm_head_stats", "lm_head_stats_logits", "lm_head_stats_backward"]


def _forward_loop(head: Head, opts: HeadOptions, logits: Optional[torch.Tensor] = None, body=None):
    """The forward's loop over row chunks: per-row (lse, logprob, entropy, lse's residual
    (``given.lse_residual``)); with
    ``logits`` given (a model-precision ``[N, V]`` buffer) each chunk's logits are
    written there too, the same values the chunk's reductions read (``body``, compiled:
    the chunk's function, by default ``forward_chunk`` or ``forward_chunk_logits``)."""
    hidden = head.hidden
    n, vocab = hidden.shape[0], head.weight.shape[0]
    lse, logprob, entropy, lse_lo = (hidden.new_zeros(n, dtype=torch.float32) for _ in range(4))
    rows = forward_rows(resolve_budget(opts.budget_bytes, hidden.device), n, vocab)
    body = compiled(body or (forward_chunk if logits is None else forward_chunk_logits))
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        chunk = head.rows(r0, r1)
        out = body(chunk.hidden, head.weight, head.bias, chunk.tokens, head.scale, opts.scale_is_div,
                   opts.want_entropy, opts.transforms)
        _store((lse, logprob, entropy, lse_lo), r0, r1, out[:4])
        if logits is not None:
            logits[r0:r1] = out[4]
    return lse, logprob, entropy, lse_lo


def _store(buffers: tuple, r0: int, r1: int, values) -> None:
    """A chunk's per-row results written into rows ``r0:r1`` of their buffers (a result the
    chunk did not compute, None, leaves its buffer's zeros)."""
    for buf, value in zip(buffers, values, strict=True):
        if value is not None:
            buf[r0:r1] = value


@torch.library.custom_op("chunked_logits::lm_head_stats", mutates_args=())
def lm_head_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  tokens: Optional[torch.Tensor], scale: Optional[torch.Tensor], scale_is_div: bool,
                  want_entropy: bool, budget_bytes: int,
                  transforms: str,
                  plan: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, logprob, entropy, lse's residual: for the backward only)."""
    return _forward_loop(Head(hidden, weight, bias, tokens, scale),
                         HeadOptions(scale_is_div, want_entropy, budget_bytes, transforms, plan))


@lm_head_stats.register_fake
def _(hidden, weight, bias, tokens, scale, scale_is_div, want_entropy, budget_bytes, transforms, plan):
    backward_plan(hidden.device, hidden.dtype, plan)  # (its one-time probe at compile time, not in a step)
    n = hidden.shape[0]
    return tuple(hidden.new_empty(n, dtype=torch.float32) for _ in range(4))


@torch.library.custom_op("chunked_logits::lm_head_stats_logits", mutates_args=())
def lm_head_stats_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         tokens: Optional[torch.Tensor], scale: Optional[torch.Tensor], scale_is_div: bool,
                         want_entropy: bool, budget_bytes: int,
                         transforms: str,
                         plan: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                             torch.Tensor]:
    """``lm_head_stats`` that also returns the model-precision logits ``[N, V]`` (the
    graph returns them): written chunk by chunk, and never an input of the backward.
    (lse, logprob, entropy, logits, lse's residual)."""
    logits = hidden.new_empty(hidden.shape[0], weight.shape[0])
    lse, logprob, entropy, lse_lo = _forward_loop(Head(hidden, weight, bias, tokens, scale),
                                                  HeadOptions(scale_is_div, want_entropy, budget_bytes,
                                                              transforms, plan), logits)
    return lse, logprob, entropy, logits, lse_lo


@lm_head_stats_logits.register_fake
def _(hidden, weight, bias, tokens, scale, scale_is_div, want_entropy, budget_bytes, transforms, plan):
    backward_plan(hidden.device, hidden.dtype, plan)  # (its one-time probe at compile time, not in a step)
    n = hidden.shape[0]
    rows = [hidden.new_empty(n, dtype=torch.float32) for _ in range(4)]
    return (*rows[:3], hidden.new_empty(n, weight.shape[0]), rows[3])


@torch.library.custom_op("chunked_logits::lm_head_stats_backward", mutates_args=())
def lm_head_stats_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           tokens: torch.Tensor, lse: torch.Tensor, entropy: Optional[torch.Tensor],
                           g_lse: torch.Tensor, g_logprob: torch.Tensor, g_entropy: torch.Tensor,
                           scale: Optional[torch.Tensor], scale_is_div: bool, budget_bytes: int,
                           transforms: str, g_logits: Optional[torch.Tensor] = None,
                           need_hidden: bool = True, need_weight: bool = True, plan: str = "auto",
                           lse_lo: Optional[torch.Tensor] = None,
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return lm_head_grads(Head(hidden, weight, bias, tokens, scale), RowValues(lse, entropy, lse_lo),
                         Cotangents(g_lse, g_logprob, g_entropy),
                         HeadOptions(scale_is_div, entropy is not None, budget_bytes, transforms, plan),
                         g_logits, need_hidden, need_weight)


@lm_head_stats_backward.register_fake
def _(hidden, weight, bias, tokens, lse, entropy, g_lse, g_logprob, g_entropy, scale, scale_is_div,
      budget_bytes, transforms, g_logits=None, need_hidden=True, need_weight=True, plan="auto", lse_lo=None):
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0),
            weight.new_empty(weight.shape[0] if bias is not None and need_weight else 0))


def _setup(ctx, inputs, output):
    lse, _, entropy = output[:3]  # (not the returned logits: the backward recomputes them)
    want_entropy = args_by_name(lm_head_stats, inputs)["want_entropy"]
    save_inputs(ctx, lm_head_stats, inputs, extra=(lse, entropy if want_entropy else None, output[-1]))
    ctx.returned = len(output) == 5  # lm_head_stats_logits: its lse was taken from the returned logits


def _backward(ctx, g_lse, g_logprob, g_entropy, *g_rest):
    """``g_logits``: the gradient of the returned logits (``lm_head_stats_logits``), added
    per tile.  Under AOTAutograd it is always a tensor: when nothing reads the logits'
    gradient the autograd engine passes zeros (``[T, V]``, allocated before the compiled
    backward runs), and adding them changes no bit of the result."""
    g_logits = g_rest[0] if ctx.returned else None  # (not the residual's: nothing reads it)
    args, (lse, entropy, lse_lo) = saved_inputs(ctx)
    hidden, weight, bias = args["hidden"], args["weight"], args["bias"]
    if ctx.returned and g_logits is None:  # (AOTAutograd always passes it) zeros, without a [T, V] buffer
        g_logits = hidden.new_zeros(()).expand(hidden.shape[0], weight.shape[0])
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    gh, gw, gb = call_by_name(lm_head_stats_backward, args, entropy=entropy, g_logits=g_logits, lse_lo=lse_lo,
                              **per_row_inputs(args["tokens"], lse, entropy, g_lse, g_logprob, g_entropy),
                              need_hidden=need_hidden, need_weight=need_weight or need_bias)
    return grads_by_name(lm_head_stats, {}, hidden=gh if need_hidden else None,
                         weight=gw if need_weight else None,
                         bias=gb if bias is not None and need_bias else None)


lm_head_stats.register_autograd(_backward, setup_context=_setup)
lm_head_stats_logits.register_autograd(_backward, setup_context=_setup)


@emitted(("lm_head_stats", "lm_head_stats_logits", "lm_head_stats_backward"), CAPTURE_SAFE)
def lm_head_row_stats(hidden, weight, bias, tokens, scale, scale_is_div: bool, want_entropy: bool,
                      budget_bytes: int, transforms: str = "", plan: str = "auto", returned_like=None):
    """Called from rewritten graphs: ``row_stats`` of ``hidden @ weight.T + bias``, after
    the logit ``transforms`` (``match.lm_head.LMHead.transforms``); ``plan``: the
    backward's (``Config.lm_head_plan``, ``tiling.backward_plan``).

    ``hidden`` is ``[.., H]``; results have ``hidden``'s shape without the last dim.
    With ``returned_like`` (the lm_head's hidden states before the region's row views,
    which keep every row) a fourth result is the model-precision logits of that shape
    ``[.., V]``: the graph returns them, and the same loop writes them.
    """
    flat = (*Head.flat(hidden, weight, bias, tokens, scale), scale_is_div, want_entropy, budget_bytes,
            transforms, plan)
    op = lm_head_stats_logits if returned_like is not None else lm_head_stats
    results = op(*flat)
    return _shaped(results, hidden.shape[:-1], tokens is not None, want_entropy, returned_like)


def _shaped(results, rows_shape, has_tokens: bool, want_entropy: bool, returned_like) -> tuple:
    """The op's flat results in the caller's row shape (None for those not computed)."""
    lse, logprob, entropy, *rest = results  # (rest: the logits if returned, then lse's residual)
    stats = (lse.reshape(rows_shape), logprob.reshape(rows_shape) if has_tokens else None,
             entropy.reshape(rows_shape) if want_entropy else None)
    if returned_like is None:
        return stats
    return (*stats, rest[0].reshape(*returned_like.shape[:-1], rest[0].shape[-1]))
