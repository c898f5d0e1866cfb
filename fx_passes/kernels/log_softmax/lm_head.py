"""lm_head inside the chunk: never materialise the logits when a matmul makes them.

When a region's logits are ``hidden @ weight.T`` in the same graph and nothing else reads
them (:mod:`fx_passes.match.lm_head`), the rewrite calls :func:`lm_head_row_stats` (op
``chunked_logits::lm_head_stats``; ``lm_head_stats_logits`` when the graph returns the logits
too): a loop over row chunks that keeps only per-row results, and a backward that recomputes
the logits tile by tile.  Each gradient element is one FP32 sum stored in model precision
once; no FP32 ``[V, H]`` or ``[T, H]`` buffer exists.  See NOTE [lm_head loop].
"""

# NOTE [lm_head loop]
# When a region's logits are ``hidden @ weight.T`` in the same graph and nothing else
# reads them (:mod:`fx_passes.match.lm_head`), the rewrite calls
# :func:`lm_head_row_stats`, which runs the custom op ``chunked_logits::lm_head_stats``:
#
# * forward: a loop over row chunks; per chunk the logits chunk is computed in model
#   precision, upcast, scaled in FP32 and reduced; only per-row results are kept.
# * backward: the logits are recomputed tile by tile and the pointwise gradient is
#   formed from the saved lse (and entropy).  Each element of ``grad_weight`` and of
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

import dataclasses
from typing import Optional

import torch

from .. import rows as rows_of
from ..ops import user_bodies
from ..ops.args import Cotangents, Head, HeadOptions, LogitMap, RowValues, args_by_name, grads_by_name
from ..ops.pair import call_by_name, save_inputs, saved_inputs
from ..ops.registry import CAPTURE_SAFE, CUDAGRAPH_UNSAFE, UNSAFE, emitted
from ..tiling import (
    accumulator_rows,
    backward_plan,
    backward_tiles,
    even_splits,
    forward_rows,
    resolve_budget,
    sweep_sizes,
)
from .bodies import backward_block, compiled, forward_chunk, forward_chunk_logits
from .given import softmax_lse
from .gpu_plan import out_dtype_blocks

__all__ = ["lm_head_row_stats", "lm_head_row_stats_masked", "lm_head_stats", "lm_head_stats_logits",
           "lm_head_stats_masked", "lm_head_stats_backward", "lm_head_stats_masked_backward",
           "lm_head_grads", "two_sweeps"]


def _forward_loop(head: Head, opts: HeadOptions, logits: Optional[torch.Tensor] = None):
    """The forward's loop over row chunks: per-row (lse, logprob, entropy); with
    ``logits`` given (a model-precision ``[N, V]`` buffer) each chunk's logits are
    written there too, the same values the chunk's reductions read."""
    hidden = head.hidden
    n, vocab = hidden.shape[0], head.weight.shape[0]
    lse, logprob, entropy = (hidden.new_zeros(n, dtype=torch.float32) for _ in range(3))
    rows = forward_rows(resolve_budget(opts.budget_bytes, hidden.device), n, vocab)
    body = compiled(forward_chunk if logits is None else forward_chunk_logits)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        chunk = head.rows(r0, r1)
        out = body(chunk.hidden, head.weight, head.bias, chunk.tokens, head.scale, opts.scale_is_div,
                   opts.want_entropy, opts.transforms)
        c_lse, c_lp, c_ent = out[:3]
        lse[r0:r1] = c_lse
        if c_lp is not None:
            logprob[r0:r1] = c_lp
        if c_ent is not None:
            entropy[r0:r1] = c_ent
        if logits is not None:
            logits[r0:r1] = out[3]
    return lse, logprob, entropy


@torch.library.custom_op("chunked_logits::lm_head_stats", mutates_args=())
def lm_head_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  tokens: Optional[torch.Tensor], scale: Optional[torch.Tensor], scale_is_div: bool,
                  want_entropy: bool, budget_bytes: int,
                  transforms: str, plan: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_loop(Head(hidden, weight, bias, tokens, scale),
                         HeadOptions(scale_is_div, want_entropy, budget_bytes, transforms, plan))


@lm_head_stats.register_fake
def _(hidden, weight, bias, tokens, scale, scale_is_div, want_entropy, budget_bytes, transforms, plan):
    backward_plan(hidden.device, hidden.dtype, plan)  # (its one-time probe at compile time, not in a step)
    n = hidden.shape[0]
    return tuple(hidden.new_empty(n, dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("chunked_logits::lm_head_stats_logits", mutates_args=())
def lm_head_stats_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         tokens: Optional[torch.Tensor], scale: Optional[torch.Tensor], scale_is_div: bool,
                         want_entropy: bool, budget_bytes: int,
                         transforms: str,
                         plan: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lm_head_stats`` that also returns the model-precision logits ``[N, V]`` (the
    graph returns them): written chunk by chunk, and never an input of the backward."""
    logits = hidden.new_empty(hidden.shape[0], weight.shape[0])
    stats = _forward_loop(Head(hidden, weight, bias, tokens, scale),
                          HeadOptions(scale_is_div, want_entropy, budget_bytes, transforms, plan), logits)
    return (*stats, logits)


@lm_head_stats_logits.register_fake
def _(hidden, weight, bias, tokens, scale, scale_is_div, want_entropy, budget_bytes, transforms, plan):
    backward_plan(hidden.device, hidden.dtype, plan)  # (its one-time probe at compile time, not in a step)
    n = hidden.shape[0]
    return (*(hidden.new_empty(n, dtype=torch.float32) for _ in range(3)),
            hidden.new_empty(n, weight.shape[0]))


@dataclasses.dataclass
class _Backward:
    """The backward's inputs, and its sweeps over the vocabulary."""

    head: Head  # its tokens: zeros where the forward had none
    saved: RowValues
    grads: Cotangents
    budget_bytes: int  # resolved
    transforms: str
    plan: str  # tiling.backward_plan
    g_logits: Optional[torch.Tensor] = None  # the returned logits' gradient [N, V], if they are returned
    scale_is_div: bool = True

    def grad_of_tile(self, body, h, w, b, v0: int, v1: int, t0: int, t1: int) -> torch.Tensor:
        """Model-precision gradient of the logits ``[t0:t1, v0:v1]``."""
        g_x = self.g_logits[t0:t1, v0:v1] if self.g_logits is not None else None
        logit_map = LogitMap(self.head.hidden.dtype, self.transforms, self.head.scale, self.scale_is_div)
        return body(h, w, b, self.head.tokens[t0:t1] - v0, self.saved.rows(t0, t1), self.grads.rows(t0, t1),
                    logit_map, g_x)

    def sweep(self, r0: int, r1: int, acc: Optional[torch.Tensor], grad_weight: Optional[torch.Tensor],
              grad_bias: Optional[torch.Tensor]) -> None:
        """One sweep over the vocabulary blocks: adds the rows ``[r0, r1)``'s
        ``grad_hidden`` into ``acc`` (FP32 ``[r1 - r0, H]``, or None); with
        ``grad_weight`` (and ``grad_bias``) given, it reads every row and writes those too."""
        hidden, weight, bias = self.head.hidden, self.head.weight, self.head.bias
        (vocab, width), body = weight.shape, compiled(backward_block)
        first, last = (0, hidden.shape[0]) if grad_weight is not None else (r0, r1)
        fp32 = self.plan == "fp32_tiles"
        if last == first:  # (no rows: no per-block work, zero sums)
            for t in (grad_weight, grad_bias):
                if t is not None:
                    t.zero_()
            return
        cols, rows = backward_tiles(self.budget_bytes, last - first, vocab, width, fp32)
        for v0, v1 in even_splits(vocab, cols):
            w32 = weight[v0:v1].float()
            b_blk = bias[v0:v1] if bias is not None else None
            w_in = w32 if fp32 else weight[v0:v1]
            b_in = b_blk.float() if fp32 and b_blk is not None else b_blk
            # grad_weight[block]: FP32 accumulation (inside one matmul, or across the row
            # tiles in this [cols, H] FP32 block), stored in model precision once
            gw = torch.zeros(v1 - v0, width, dtype=torch.float32, device=weight.device) \
                if fp32 and grad_weight is not None else None
            gb = torch.zeros(v1 - v0, dtype=torch.float32, device=weight.device) \
                if grad_bias is not None else None
            for t0, t1 in even_splits(last - first, rows):
                t0, t1 = t0 + first, t1 + first
                h_in = hidden[t0:t1].float() if fp32 else hidden[t0:t1]
                g = self.grad_of_tile(body, h_in, w_in, b_in, v0, v1, t0, t1)
                g32 = g.float()
                if gw is not None:
                    gw.addmm_(g32.t(), h_in)
                elif grad_weight is not None:  # one row tile: all rows
                    torch.mm(g.t(), h_in, out=grad_weight[v0:v1])
                if gb is not None:
                    gb += g32.sum(0)
                a0, a1 = max(t0, r0), min(t1, r1)  # the tile's rows this sweep accumulates
                if acc is not None and a0 < a1:
                    acc[a0 - r0:a1 - r0].addmm_(g32[a0 - t0:a1 - t0], w32)
            if gw is not None:
                grad_weight[v0:v1] = gw
            if gb is not None:
                grad_bias[v0:v1] = gb

    def tile(self, t0: int, t1: int, v0: int, v1: int) -> torch.Tensor:
        """``grad_of_tile`` of the model-precision operands (``two_sweeps``)."""
        head = self.head
        b = head.bias[v0:v1] if head.bias is not None else None
        return self.grad_of_tile(compiled(backward_block), head.hidden[t0:t1], head.weight[v0:v1], b,
                                 v0, v1, t0, t1)


def two_sweeps(hidden: torch.Tensor, weight: torch.Tensor, budget_bytes: int, grad_of_tile,
               grad_hidden: Optional[torch.Tensor], grad_weight: Optional[torch.Tensor],
               grad_bias: Optional[torch.Tensor] = None) -> None:
    """The ``"two_sweeps"`` backward of ``hidden @ weight.T`` (``tiling.backward_plan``):
    ``grad_of_tile(t0, t1, v0, v1)`` is the model-precision gradient of the logits
    ``[t0:t1, v0:v1]``.  Row chunks over the whole vocabulary write ``grad_hidden``,
    vocabulary blocks over all rows write ``grad_weight`` (and ``grad_bias``), one
    model-precision matmul each, its whole sum inside it; one tile exists at a time.
    A gradient given as None is not computed."""
    n, vocab = hidden.shape[0], weight.shape[0]
    rows, cols = sweep_sizes(budget_bytes, n, vocab)
    if grad_hidden is not None:
        for t0, t1 in even_splits(n, rows):
            g = grad_of_tile(t0, t1, 0, vocab)
            torch.mm(g, weight, out=grad_hidden[t0:t1])
            del g  # (before the next tile's logits exist)
    if grad_weight is not None:
        for t in (grad_weight, grad_bias) if n == 0 else ():  # (no rows: no per-block work, zero sums)
            if t is not None:
                t.zero_()
        for v0, v1 in even_splits(vocab, cols) if n else ():
            g = grad_of_tile(0, n, v0, v1)
            torch.mm(g.t(), hidden, out=grad_weight[v0:v1])
            if grad_bias is not None:
                grad_bias[v0:v1] = g.sum(0, dtype=torch.float32)
            del g


# NOTE [lm_head gradient sweeps]
# ``grad_weight[block]`` needs every row and ``grad_hidden[rows]`` every block; each
# is accumulated in FP32 and rounded once.  ``"two_sweeps"`` (``tiling.backward_plan``)
# runs one sweep for each.  Otherwise the first sweep over the vocabulary blocks reads
# all rows: it writes ``grad_weight`` and ``grad_bias`` and accumulates the first group
# of rows' ``grad_hidden`` in an FP32 ``[S, H]`` buffer (``S`` from the budget: all
# rows when ``4 T H`` bytes fit in half of it, so W4-sized problems take one sweep);
# ``"gpu"`` does it with model-precision GEMM inputs (``gpu_plan.out_dtype_blocks``).
# Each further group of ``S`` rows takes a sweep of its own, which recomputes those
# rows' logits: at long T the backward trades that extra matmul for an accumulator
# bounded by the budget instead of growing with T.
def lm_head_grads(head: Head, saved: RowValues, grads: Cotangents, opts: HeadOptions,
                  g_logits: Optional[torch.Tensor] = None, need_hidden: bool = True,
                  need_weight: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``hidden``, ``weight`` and ``bias`` (an empty tensor for one not
    needed: ``need_weight`` covers the bias), with no FP32 ``[T, H]`` buffer; each element
    accumulated in FP32 and rounded once, in the sweeps of ``opts.plan``.  ``head.tokens``:
    zeros where the forward had none; ``grads``: each a tensor (zeros for none flowing),
    the g_logprob / g_entropy read only where the forward computed those results; ``opts``'
    ``want_entropy`` is not read (``saved.entropy`` is None or not).  See NOTE [lm_head
    gradient sweeps].
    """
    hidden, weight, bias = head.hidden, head.weight, head.bias
    n, width = hidden.shape
    grad_hidden = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    grad_weight = torch.empty_like(weight) if need_weight else weight.new_empty(0)
    grad_bias = torch.zeros(weight.shape[0] if bias is not None and need_weight else 0, dtype=weight.dtype,
                            device=weight.device)
    with_bias = grad_bias if bias is not None and need_weight else None
    plan = backward_plan(hidden.device, hidden.dtype, opts.plan)
    budget_bytes = resolve_budget(opts.budget_bytes, hidden.device)
    bwd = _Backward(head, saved, grads, budget_bytes, opts.transforms, plan, g_logits, opts.scale_is_div)
    if plan in ("two_sweeps", "gpu"):
        loops = two_sweeps if plan == "two_sweeps" else out_dtype_blocks
        loops(hidden, weight, budget_bytes, bwd.tile, grad_hidden if need_hidden else None,
              grad_weight if need_weight else None, with_bias)
        return grad_hidden, grad_weight, grad_bias
    if not need_hidden:
        bwd.sweep(0, 0, None, grad_weight, with_bias)
        return grad_hidden, grad_weight, grad_bias
    acc = torch.empty(accumulator_rows(budget_bytes, n, width), width, dtype=torch.float32,
                      device=hidden.device)
    for r0, r1 in even_splits(n, acc.shape[0]) or [(0, 0)]:  # (no rows: one sweep, zero sums)
        group = acc[:r1 - r0].zero_()
        first = r0 == 0 and need_weight
        bwd.sweep(r0, r1, group, grad_weight if first else None, with_bias if first else None)
        grad_hidden[r0:r1] = group
    return grad_hidden, grad_weight, grad_bias


@torch.library.custom_op("chunked_logits::lm_head_stats_backward", mutates_args=())
def lm_head_stats_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           tokens: torch.Tensor, lse: torch.Tensor, entropy: Optional[torch.Tensor],
                           g_lse: torch.Tensor, g_logprob: torch.Tensor, g_entropy: torch.Tensor,
                           scale: Optional[torch.Tensor], scale_is_div: bool, budget_bytes: int,
                           transforms: str, g_logits: Optional[torch.Tensor] = None,
                           need_hidden: bool = True, need_weight: bool = True, plan: str = "auto",
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return lm_head_grads(Head(hidden, weight, bias, tokens, scale), RowValues(lse, entropy),
                         Cotangents(g_lse, g_logprob, g_entropy),
                         HeadOptions(scale_is_div, entropy is not None, budget_bytes, transforms, plan),
                         g_logits, need_hidden, need_weight)


@lm_head_stats_backward.register_fake
def _(hidden, weight, bias, tokens, lse, entropy, g_lse, g_logprob, g_entropy, scale, scale_is_div,
      budget_bytes, transforms, g_logits=None, need_hidden=True, need_weight=True, plan="auto"):
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0),
            weight.new_empty(weight.shape[0] if bias is not None and need_weight else 0))


def _setup(ctx, inputs, output):
    lse, _, entropy = output[:3]  # (not the returned logits: the backward recomputes them)
    want_entropy = args_by_name(lm_head_stats, inputs)["want_entropy"]
    save_inputs(ctx, lm_head_stats, inputs, extra=(lse, entropy if want_entropy else None))
    ctx.returned = len(output) == 4  # lm_head_stats_logits: its lse was taken from the returned logits


def _backward(ctx, g_lse, g_logprob, g_entropy, g_logits=None):
    """``g_logits``: the gradient of the returned logits (``lm_head_stats_logits``), added
    per tile.  Under AOTAutograd it is always a tensor: when nothing reads the logits'
    gradient the autograd engine passes zeros (``[T, V]``, allocated before the compiled
    backward runs), and adding them changes no bit of the result."""
    args, (lse, entropy) = saved_inputs(ctx)
    hidden, weight, bias, tokens = args["hidden"], args["weight"], args["bias"], args["tokens"]
    zeros = lse.new_zeros(lse.shape)
    g_lse = g_lse if g_lse is not None else zeros
    g_logprob = g_logprob if (g_logprob is not None and tokens is not None) else zeros
    g_entropy = g_entropy if (g_entropy is not None and entropy is not None) else zeros
    lse = softmax_lse(lse, log_softmax=tokens is not None or entropy is not None)
    if tokens is None:
        tokens = torch.zeros(lse.shape, dtype=torch.long, device=lse.device)
    if ctx.returned and g_logits is None:  # (AOTAutograd always passes it) zeros, without a [T, V] buffer
        g_logits = hidden.new_zeros(()).expand(hidden.shape[0], weight.shape[0])
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    gh, gw, gb = call_by_name(lm_head_stats_backward, args, tokens=tokens, lse=lse, entropy=entropy,
                              g_lse=g_lse, g_logprob=g_logprob, g_entropy=g_entropy, g_logits=g_logits,
                              need_hidden=need_hidden, need_weight=need_weight or need_bias)
    return grads_by_name(lm_head_stats, {}, hidden=gh if need_hidden else None,
                         weight=gw if need_weight else None,
                         bias=gb if bias is not None and need_bias else None)


lm_head_stats.register_autograd(_backward, setup_context=_setup)
lm_head_stats_logits.register_autograd(_backward, setup_context=_setup)


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
        return (*_forward_loop(head, opts), torch.arange(n, device=dev), torch.tensor(n, device=HOST))
    results = tuple(head.hidden.new_zeros(n, dtype=torch.float32).index_copy_(0, kept, r)
                    for r in _forward_loop(head.take(kept), opts))
    index = kept.new_zeros(n)
    index[:kept.shape[0]] = kept
    return (*results, index, torch.tensor(kept.shape[0], device=HOST))


@torch.library.custom_op("chunked_logits::lm_head_stats_masked", mutates_args=(), tags=UNSAFE)
def lm_head_stats_masked(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         tokens: Optional[torch.Tensor], scale: Optional[torch.Tensor], scale_is_div: bool,
                         want_entropy: bool, budget_bytes: int, transforms: str, plan: str, mask_key: str,
                         operands: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                torch.Tensor, torch.Tensor]:
    """``lm_head_stats`` on the rows the skip graph ``mask_key`` cannot leave out (its
    ``operands``: the tensors it reads); (lse, logprob, entropy: 0 on the rows left out,
    index: the rows run first, count: how many, 0-d, in host memory)."""
    return _masked_forward(Head(hidden, weight, bias, tokens, scale),
                           HeadOptions(scale_is_div, want_entropy, budget_bytes, transforms, plan), mask_key,
                           operands)


@lm_head_stats_masked.register_fake
def _(hidden, weight, bias, tokens, scale, scale_is_div, want_entropy, budget_bytes, transforms, plan,
      mask_key, operands):
    backward_plan(hidden.device, hidden.dtype, plan)
    n = hidden.shape[0]
    return (*(hidden.new_empty(n, dtype=torch.float32) for _ in range(3)),
            hidden.new_empty(n, dtype=torch.int64), hidden.new_empty((), dtype=torch.int64, device=HOST))


def _setup_masked(ctx, inputs, output):
    lse, _, entropy, index, count = output
    want_entropy = args_by_name(lm_head_stats_masked, inputs)["want_entropy"]
    save_inputs(ctx, lm_head_stats_masked, inputs,
                extra=(lse, entropy if want_entropy else None, index, count), names=Head._fields)


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
                               RowValues(lse, run(saved.entropy)), Cotangents(*(run(g) for g in grads)), opts,
                               None, *need)
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
                                  index: torch.Tensor,
                                  count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lm_head_stats_backward`` over the rows run (``index[:count]``); a row left out gets
    stock's gradient from its cotangent: exactly 0, or NaN where that is not 0 (NOTE
    [per-token rows a mask leaves out])."""
    return _masked_grads(Head(hidden, weight, bias, tokens, scale), RowValues(lse, entropy),
                         Cotangents(g_lse, g_logprob, g_entropy),
                         HeadOptions(scale_is_div, entropy is not None, budget_bytes, transforms, plan),
                         (need_hidden, need_weight), (index, count))


@lm_head_stats_masked_backward.register_fake
def _(hidden, weight, bias, tokens, lse, entropy, g_lse, g_logprob, g_entropy, scale, scale_is_div,
      budget_bytes, transforms, need_hidden, need_weight, plan, index, count):
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0),
            weight.new_empty(weight.shape[0] if bias is not None and need_weight else 0))


def _backward_masked(ctx, g_lse, g_logprob, g_entropy, *_):
    """``_backward`` over the rows the forward ran (``lm_head_stats_masked_backward``)."""
    args, (lse, entropy, index, count) = saved_inputs(ctx)
    bias, tokens = args["bias"], args["tokens"]
    zeros = lse.new_zeros(lse.shape)
    g_lse = g_lse if g_lse is not None else zeros
    g_logprob = g_logprob if (g_logprob is not None and tokens is not None) else zeros
    g_entropy = g_entropy if (g_entropy is not None and entropy is not None) else zeros
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    gh, gw, gb = call_by_name(lm_head_stats_masked_backward, args, lse=lse, entropy=entropy, g_lse=g_lse,
                              g_logprob=g_logprob, g_entropy=g_entropy, need_hidden=need_hidden,
                              need_weight=need_weight or need_bias, index=index, count=count)
    return grads_by_name(lm_head_stats_masked, ctx.lengths, hidden=gh if need_hidden else None,
                         weight=gw if need_weight else None,
                         bias=gb if bias is not None and need_bias else None)


lm_head_stats_masked.register_autograd(_backward_masked, setup_context=_setup_masked)


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


@emitted(("lm_head_stats_masked", "lm_head_stats_masked_backward"), CUDAGRAPH_UNSAFE)
def lm_head_row_stats_masked(hidden, weight, bias, tokens, scale, scale_is_div: bool, want_entropy: bool,
                             budget_bytes: int, transforms: str = "", plan: str = "auto", *, mask_key: str,
                             mask_operands):
    """:func:`lm_head_row_stats` (no logits returned) on the rows the skip graph of the
    results' readers cannot leave out: ``mask_key`` (``match/row_mask.skip_rows_of_reads``)
    and the tensors it reads, ``mask_operands`` (NOTE [per-token rows a mask leaves out];
    ``rewrite/loss_tail.skip_unread_rows`` puts this call in place of the plain one)."""
    flat = (*Head.flat(hidden, weight, bias, tokens, scale), scale_is_div, want_entropy, budget_bytes,
            transforms, plan)
    operands = [o.reshape(-1) if o.dim() else o for o in mask_operands]
    results = lm_head_stats_masked(*flat, mask_key, operands)
    return _shaped(results[:3], hidden.shape[:-1], tokens is not None, want_entropy, None)


def _shaped(results, rows_shape, has_tokens: bool, want_entropy: bool, returned_like) -> tuple:
    """The op's flat results in the caller's row shape (None for those not computed)."""
    lse, logprob, entropy, *logits = results
    stats = (lse.reshape(rows_shape), logprob.reshape(rows_shape) if has_tokens else None,
             entropy.reshape(rows_shape) if want_entropy else None)
    if returned_like is None:
        return stats
    return (*stats, logits[0].reshape(*returned_like.shape[:-1], logits[0].shape[-1]))
