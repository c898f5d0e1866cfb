"""Per-token lm_head statistics on the rows a mask leaves in: :func:`lm_head_row_stats_masked`.

The loop of :mod:`.lm_head` (op ``chunked_logits::lm_head_stats_masked`` and its backward) on
the rows the skip graph of the results' readers cannot leave out; a row left out gets 0 for
its results and stock's gradient.  See NOTE [per-token rows a mask leaves out].
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import rows as rows_of
from ..ops import user_bodies
from ..ops.args import Cotangents, Head, HeadOptions, RowValues, args_by_name, grads_by_name
from ..ops.pair import call_by_name, save_inputs, saved_inputs
from ..ops.registry import CUDAGRAPH_UNSAFE, UNSAFE, emitted
from ..tiling import backward_plan
from .given import softmax_lse
from .lm_head import _forward_loop, _shaped
from .lm_head_sweeps import lm_head_grads

__all__ = ["lm_head_row_stats_masked", "lm_head_stats_masked", "lm_head_stats_masked_backward"]


# NOTE [per-token rows a mask leaves out]
# When every value the graph reads of the per-token results is exactly 0 on a row (a masked
# sum, a masked per-row value) and no result of that row gets a gradient but 0, whatever the
# results hold (``match/row_mask.skip_rows_of_reads``), the loop leaves the row out: its
# results are 0 (inside the intervals the proof assumed), the graph's own ops compute the
# same zeros as stock, and its gradient is stock's exact 0.  A sum's incoming gradient is
# not known in the forward; if it is not finite, a skipped row's cotangent is ``0 * inf``,
# NaN, where stock's gradients turn NaN: the backward does the same (the row's
# ``grad_hidden`` and every weight gradient NaN, as stock's ``NaN @ W``, ``NaN.T @ h``).
# Finding the rows costs one read of a device value a step (``rows.select``: the count, in
# the forward); the count then travels to the backward as a host tensor (``HOST``), which
# reads it from host memory (``tolist``: no op, no sync).  A host tensor and a host read
# are what a CUDA graph cannot replay: both ops are ``cudagraph_unsafe`` (Inductor's
# ``reduce-overhead`` runs them between its captured parts), and inside a capture
# ``rows.select`` reads nothing and every row runs.
HOST = torch.device("cpu")


def _kept_rows(head: Head, opts: HeadOptions, mask_key: str, operands: list[torch.Tensor]):
    """The rows to run (ascending), or None for every row (module NOTE)."""
    hidden, weight = head.hidden, head.weight
    if not mask_key:
        return None
    z = rows_of.logit_bounds(hidden, weight, head.bias, head.scale, opts.scale_is_div, opts.transforms)
    skip = user_bodies.function(mask_key)(*rows_of.item_bounds(z, weight.shape[0]), *operands)
    return rows_of.select(skip.expand(hidden.shape[0]))


def _masked_forward(head: Head, opts: HeadOptions, mask_key: str, operands: list[torch.Tensor]) -> tuple:
    """``lm_head_stats_masked``'s results (module NOTE)."""
    n, dev = head.hidden.shape[0], head.hidden.device
    kept = _kept_rows(head, opts, mask_key, operands)
    if kept is None:
        lse, logprob, entropy, lse_lo = _forward_loop(head, opts)
        return lse, logprob, entropy, torch.arange(n, device=dev), torch.tensor(n, device=HOST), lse_lo
    lse, logprob, entropy, lse_lo = (head.hidden.new_zeros(n, dtype=torch.float32).index_copy_(0, kept, r)
                                     for r in _forward_loop(head.take(kept), opts))
    index = kept.new_zeros(n)
    index[:kept.shape[0]] = kept
    return lse, logprob, entropy, index, torch.tensor(kept.shape[0], device=HOST), lse_lo


@torch.library.custom_op("chunked_logits::lm_head_stats_masked", mutates_args=(), tags=UNSAFE)
def lm_head_stats_masked(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         tokens: Optional[torch.Tensor], scale: Optional[torch.Tensor], scale_is_div: bool,
                         want_entropy: bool, budget_bytes: int, transforms: str, plan: str, mask_key: str,
                         operands: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lm_head_stats`` on the rows the skip graph ``mask_key`` cannot leave out (its
    ``operands``: the tensors it reads); (lse, logprob, entropy: 0 on the rows left out,
    index: the rows run first, count: how many, 0-d, in host memory, lse's residual: for
    the backward only)."""
    return _masked_forward(Head(hidden, weight, bias, tokens, scale),
                           HeadOptions(scale_is_div, want_entropy, budget_bytes, transforms, plan), mask_key,
                           operands)


@lm_head_stats_masked.register_fake
def _(hidden, weight, bias, tokens, scale, scale_is_div, want_entropy, budget_bytes, transforms, plan,
      mask_key, operands):
    backward_plan(hidden.device, hidden.dtype, plan)
    n = hidden.shape[0]
    return (*(hidden.new_empty(n, dtype=torch.float32) for _ in range(3)),
            hidden.new_empty(n, dtype=torch.int64), hidden.new_empty((), dtype=torch.int64, device=HOST),
            hidden.new_empty(n, dtype=torch.float32))


def _setup_masked(ctx, inputs, output):
    lse, _, entropy, index, count, lse_lo = output
    want_entropy = args_by_name(lm_head_stats_masked, inputs)["want_entropy"]
    save_inputs(ctx, lm_head_stats_masked, inputs,
                extra=(lse, entropy if want_entropy else None, index, count, lse_lo), names=Head._fields)


def _masked_grads(head: Head, saved: RowValues, grads: Cotangents, opts: HeadOptions, need: tuple[bool, bool],
                  kept: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """``lm_head_stats_masked_backward`` (``need``: (hidden, weight) gradients wanted;
    ``kept``: (index, count) of the rows the forward ran)."""
    (index, count), hidden, tokens = kept, head.hidden, head.tokens
    n, k = hidden.shape[0], count.tolist()  # (host memory: no op, no device sync)
    rows = index[:k]

    def run(t):  # (the rows run: every row when none was left out, without a copy)
        return t if t is None or k == n else t[rows]
    lse = softmax_lse(run(saved.lse), log_softmax=tokens is not None or saved.entropy is not None)
    tok = run(tokens) if tokens is not None else torch.zeros(k, dtype=torch.long, device=lse.device)
    gh, gw, gb = lm_head_grads(head._replace(hidden=run(hidden), tokens=tok),
                               RowValues(lse, run(saved.entropy), run(saved.lse_lo)),
                               Cotangents(*(run(g) for g in grads)), opts, None, *need)
    if k == n:
        return gh, gw, gb
    left = torch.ones(n, dtype=torch.bool, device=hidden.device).index_fill_(0, rows, False)
    nan = left & ((grads.lse != 0) | (grads.logprob != 0) | (grads.entropy != 0))
    if need[0]:
        gh = gh.new_zeros(n, gh.shape[1]).index_copy_(0, rows, gh).masked_fill_(nan[:, None], float("nan"))
    any_nan = nan.any()  # (in place: no second [V, H] buffer)
    return gh, gw.masked_fill_(any_nan, float("nan")), gb.masked_fill_(any_nan, float("nan"))


@torch.library.custom_op("chunked_logits::lm_head_stats_masked_backward", mutates_args=(), tags=UNSAFE)
def lm_head_stats_masked_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                  tokens: Optional[torch.Tensor], lse: torch.Tensor,
                                  entropy: Optional[torch.Tensor], g_lse: torch.Tensor,
                                  g_logprob: torch.Tensor, g_entropy: torch.Tensor,
                                  scale: Optional[torch.Tensor], scale_is_div: bool, budget_bytes: int,
                                  transforms: str, need_hidden: bool, need_weight: bool, plan: str,
                                  index: torch.Tensor, count: torch.Tensor,
                                  lse_lo: Optional[torch.Tensor] = None
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lm_head_stats_backward`` over the rows run (``index[:count]``); a row left out gets
    stock's gradient from its cotangent: exactly 0, or NaN where that is not 0 (NOTE
    [per-token rows a mask leaves out])."""
    return _masked_grads(Head(hidden, weight, bias, tokens, scale), RowValues(lse, entropy, lse_lo),
                         Cotangents(g_lse, g_logprob, g_entropy),
                         HeadOptions(scale_is_div, entropy is not None, budget_bytes, transforms, plan),
                         (need_hidden, need_weight), (index, count))


@lm_head_stats_masked_backward.register_fake
def _(hidden, weight, bias, tokens, lse, entropy, g_lse, g_logprob, g_entropy, scale, scale_is_div,
      budget_bytes, transforms, need_hidden, need_weight, plan, index, count, lse_lo=None):
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0),
            weight.new_empty(weight.shape[0] if bias is not None and need_weight else 0))


def _backward_masked(ctx, g_lse, g_logprob, g_entropy, *_):
    """``_backward`` over the rows the forward ran (``lm_head_stats_masked_backward``)."""
    args, (lse, entropy, index, count, lse_lo) = saved_inputs(ctx)
    bias, tokens = args["bias"], args["tokens"]
    zeros = lse.new_zeros(lse.shape)
    g_lse = g_lse if g_lse is not None else zeros
    g_logprob = g_logprob if (g_logprob is not None and tokens is not None) else zeros
    g_entropy = g_entropy if (g_entropy is not None and entropy is not None) else zeros
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    gh, gw, gb = call_by_name(lm_head_stats_masked_backward, args, lse=lse, entropy=entropy, g_lse=g_lse,
                              g_logprob=g_logprob, g_entropy=g_entropy, need_hidden=need_hidden,
                              need_weight=need_weight or need_bias, index=index, count=count,
                              lse_lo=lse_lo)
    return grads_by_name(lm_head_stats_masked, ctx.lengths, hidden=gh if need_hidden else None,
                         weight=gw if need_weight else None,
                         bias=gb if bias is not None and need_bias else None)


lm_head_stats_masked.register_autograd(_backward_masked, setup_context=_setup_masked)


@emitted(("lm_head_stats_masked", "lm_head_stats_masked_backward"), CUDAGRAPH_UNSAFE)
def lm_head_row_stats_masked(hidden, weight, bias, tokens, scale, scale_is_div: bool, want_entropy: bool,
                             budget_bytes: int, transforms: str = "", plan: str = "auto", *, mask_key: str,
                             mask_operands):
    """:func:`lm_head_row_stats` (no logits returned) on the rows the skip graph of the
    results' readers cannot leave out: ``mask_key`` (``match/row_mask.skip_rows_of_reads``)
    and the tensors it reads, ``mask_operands`` (NOTE [per-token rows a mask leaves out];
    ``rewrite/skip_rows.skip_unread_rows`` puts this call in place of the plain one)."""
    flat = (*Head.flat(hidden, weight, bias, tokens, scale), scale_is_div, want_entropy, budget_bytes,
            transforms, plan)
    operands = [o.reshape(-1) if o.dim() else o for o in mask_operands]
    results = lm_head_stats_masked(*flat, mask_key, operands)
    return _shaped(results[:3], hidden.shape[:-1], tokens is not None, want_entropy, None)
