"""The lm_head backward's sweeps: the gradients of ``hidden @ weight.T + bias`` from the saved
per-row statistics, the logits recomputed tile by tile, each element one FP32 sum rounded once.

:func:`lm_head_grads` runs the plan ``tiling.backward_plan`` picks: :func:`two_sweeps` (row
chunks write ``grad_hidden``, vocabulary blocks ``grad_weight``; also the vocab-parallel shard's
order), ``"gpu"`` (``gpu_plan.out_dtype_blocks``) or one sweep over the vocabulary blocks per
group of rows (``_Backward.sweep``).  ``lm_head_stats_backward`` (:mod:`.lm_head`), the masked
per-token op (:mod:`.lm_head_masked`) and ``lm_head_loss``'s backward (:mod:`.loss`) call it.
See NOTE [lm_head gradient sweeps].
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..ops.args import Cotangents, Head, HeadOptions, LogitMap, RowValues
from ..tiling import accumulator_rows, backward_plan, backward_tiles, even_splits, resolve_budget, sweep_sizes
from .bodies import backward_block, compiled
from .gpu_plan import out_dtype_blocks

__all__ = ["lm_head_grads", "two_sweeps"]


# NOTE [the logits the backward recomputes]
# The backward forms each row's gradient from the logits it recomputes and the ``lse`` /
# entropy the forward saved, so the two must see the same model-precision logits: at a
# confident row ``sum_v p_v (l_v + H) = 0`` cancels, and logits one spacing apart between
# the passes made an fp16 hidden-state gradient 8x stock's error (vocabulary 2, seen by the
# property tests' long profile).  The plans recompute them with the op the forward ran
# (``F.linear`` in model precision), or, ``"fp32_tiles"``, as an FP32 product rounded once:
# the same values where the forward's GEMM rounds its FP32 sum once.  A bias is where
# kernels differ: a CPU's fp16 / bf16 ``linear`` may round the product before adding the
# bias (``round(round(h @ w) + b)``), so with a bias ``"fp32_tiles"`` recomputes the logits
# from the model-precision operands as the forward did (its gradient GEMMs stay FP32).


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
        # (with a bias, fp32_tiles recomputes the logits from the model-precision operands,
        # as the forward made them: NOTE [the logits the backward recomputes])
        fp32_logits = fp32 and bias is None
        for v0, v1 in even_splits(vocab, cols):
            w32 = weight[v0:v1].float()
            b_blk = bias[v0:v1] if bias is not None else None
            w_in = w32 if fp32 else weight[v0:v1]
            w_logits = w32 if fp32_logits else weight[v0:v1]
            # grad_weight[block]: FP32 accumulation (inside one matmul, or across the row
            # tiles in this [cols, H] FP32 block), stored in model precision once
            gw = torch.zeros(v1 - v0, width, dtype=torch.float32, device=weight.device) \
                if fp32 and grad_weight is not None else None
            gb = torch.zeros(v1 - v0, dtype=torch.float32, device=weight.device) \
                if grad_bias is not None else None
            for t0, t1 in even_splits(last - first, rows):
                t0, t1 = t0 + first, t1 + first
                h_in = hidden[t0:t1].float() if fp32 else hidden[t0:t1]
                h_logits = h_in if fp32_logits else hidden[t0:t1]
                g = self.grad_of_tile(body, h_logits, w_logits, b_blk, v0, v1, t0, t1)
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
                del g, g32, h_in, h_logits  # (before the next tile's gradient and its FP32 copy are made)
            if gw is not None:
                grad_weight[v0:v1] = gw
            if gb is not None:
                grad_bias[v0:v1] = gb
            del w32, w_in, w_logits, gw, gb  # (the block's FP32 copies and sums, before the next block's)

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
