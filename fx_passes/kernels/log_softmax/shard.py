"""The lm_head inside a vocab-parallel region, so no rank holds its logits shard whole.

:func:`shard_lm_head` takes ``hidden`` and the weight shard of a stage whose shard is
``hidden @ weight_shard.T`` read by nothing else, and returns what
:func:`~fx_passes.distributed.shard_reduce.shard_reduce` would on the logits: the stage's
reductions, computed per row chunk on model-precision logits.  The backward (one stage at
most) is local, as stock's, and rounds each gradient element once.
``fx_passes.distributed.shard_stages._fusable_lm_head`` says whether a region qualifies.

See NOTE [shard lm_head loops].
"""

# NOTE [shard lm_head loops]
# * forward: a loop over row chunks; per chunk the logits ``[rows, V / world]`` are computed
#   in model precision and the stage's reductions (its compiled body,
#   fx_passes.kernels.ops.user_bodies) run on them.  Called per stage, each stage computes its
#   chunks again (a stage's per-row operands, the all-reduced max, exist only after the
#   previous stage); fx_passes.distributed.one_pass runs all stages in one such loop when
#   the code between them is per row.
# * backward (at most one stage needs a gradient, as for ``shard_reduce``): the logits
#   gradient of a tile is the stage's vector-Jacobian product on the recomputed tile, in
#   model precision, and the lm_head backward's loops run the tiles, every gradient element
#   one FP32 sum rounded once, no collective (``backward_loops``, by ``Config.lm_head_plan``
#   and the device as ``tiling.backward_plan`` chooses):
#   - "gpu" (CUDA / XPU: ``gpu_plan.out_dtype_blocks``): vocabulary blocks over all rows,
#     each recomputed once, write ``grad_weight[block]`` and add ``grad_hidden`` into an
#     FP32 sum inside their GEMMs (``out_dtype``): four ``[T, H] x [H, V / world]`` GEMMs a
#     step with the forward's;
#   - "two_sweeps" (every other plan: these loops have no "blocks" or "fp32_tiles", which
#     make FP32 copies of the operands): row chunks over the whole shard write
#     ``grad_hidden[rows]`` and vocabulary blocks over all rows ``grad_weight[block]``, one
#     model-precision matmul each: five GEMMs a step (each sweep recomputes the logits).
# A block of columns runs the stage's ops on those columns only, so a stage that needs a
# gradient may end in sums and gathers (each a sum over columns) and no other reduction;
# the gather's index is shifted by the block's first column.

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ...reporting.report import say_once
from ..ops import user_bodies
from ..ops.args import grads_by_name
from ..ops.pair import call_by_name, grads_or_zeros, keep_result_specs, save_inputs, saved_inputs
from ..ops.registry import CAPTURE_SAFE, GATHER_INDEXES, emitted
from ..tiling import backward_plan, even_splits, resolve_budget, sweep_sizes
from .gpu_plan import out_dtype_blocks
from .lm_head_sweeps import two_sweeps

__all__ = ["shard_lm_head", "gather_index_positions", "row_chunks", "backward_loops", "stage_tile_grad"]

# Per stage key: which operands are a gather's index (shifted per block of columns).


def gather_index_positions(key: str, positions: tuple[int, ...]) -> None:
    """Record which of stage ``key``'s operands are gather indexes (see the module doc)."""
    GATHER_INDEXES.add(key, positions)


def _rows(operands, t0: int, t1: int, n: int) -> list[torch.Tensor]:
    """The operands of rows ``[t0, t1)``: per-row ones sliced, scalars as they are."""
    return [o[t0:t1] if o.dim() > 0 and o.shape[0] == n and o.numel() == n else o for o in operands]


def _columns(key: str, operands, v0: int) -> list[torch.Tensor]:
    """The operands of a block of columns starting at ``v0``: gather indexes shifted
    (an index outside the block then matches no column of it)."""
    positions = GATHER_INDEXES.get(key, ())
    return [o - v0 if i in positions else o for i, o in enumerate(operands)]


def row_chunks(hidden, weight, operands, splits, run, into: Optional[torch.Tensor] = None
               ) -> Optional[list[torch.Tensor]]:
    """Per row chunk ``[t0, t1)`` of ``splits``: its model-precision logits
    ``hidden[t0:t1] @ weight.T`` (one chunk at a time; written into ``into[t0:t1]`` where
    given), ``run(logits, *its operands)``, and the per-row results written into
    whole-rows outputs (None when there are no rows)."""
    n = hidden.shape[0]
    outs: Optional[list[torch.Tensor]] = None
    for t0, t1 in splits:
        with torch.no_grad():
            h, w = hidden[t0:t1].detach(), weight.detach()
            x = F.linear(h, w) if into is None else torch.mm(h, w.t(), out=into[t0:t1])
            got = run(x, *_rows(operands, t0, t1, n))
        del x  # (before the next chunk's logits exist: one chunk at a time)
        if outs is None:
            outs = [g.new_empty((n, *g.shape[1:])) for g in got]
        for out, g in zip(outs, got):
            out[t0:t1] = g
    return outs


def stage_tile_grad(key: str, x: torch.Tensor, operands, grads, n: int, t0: int, v0: int = 0) -> torch.Tensor:
    """Stage ``key``'s model-precision logits gradient on ``x``, the tile of the shard's
    logits at rows ``t0 ..`` (of ``n``) and columns ``v0 ..``: its vjp on the tile's
    operands (gather indexes shifted by ``v0``) and incoming gradients."""
    t1, vjp = t0 + x.shape[0], user_bodies.backward_body(key, (0,))
    return vjp(x, *_rows(_columns(key, operands, v0), t0, t1, n), *_rows(grads, t0, t1, n))[0]


def backward_loops(plan: str, hidden: torch.Tensor) -> Callable:
    """The loops of a vocab-parallel lm_head backward on ``hidden``'s device for
    ``Config.lm_head_plan`` ``plan`` (NOTE [shard lm_head loops]): ``out_dtype_blocks``
    where ``tiling.backward_plan`` says "gpu", else ``two_sweeps`` (a plan these loops do
    not have, said once)."""
    chosen = backward_plan(hidden.device, hidden.dtype, plan)
    if chosen == "gpu":
        return out_dtype_blocks
    if chosen != "two_sweeps" and plan != "auto":
        say_once(logging.INFO, "chunked_logits: the vocab-parallel lm_head backward has no %r plan: it runs "
                 "'two_sweeps'", chosen)
    return two_sweeps


def _forward(key: str, hidden, weight, operands, budget_bytes: int) -> list[torch.Tensor]:
    rows, _ = sweep_sizes(resolve_budget(budget_bytes, hidden.device), hidden.shape[0], weight.shape[0])
    outs = row_chunks(hidden, weight, operands, even_splits(hidden.shape[0], rows), user_bodies.body(key))
    return outs if outs is not None else _fake(key, hidden, weight, operands)


def _fake(key: str, hidden, weight, operands) -> list[torch.Tensor]:
    x = hidden.new_empty(hidden.shape[0], weight.shape[0])
    return [torch.empty_like(o) for o in user_bodies.fake_function(key)(x, *operands)]


@torch.library.custom_op("chunked_logits::shard_lm_head", mutates_args=())
def _shard_lm_head(key: str, hidden: torch.Tensor, weight: torch.Tensor, operands: list[torch.Tensor],
                   budget_bytes: int, plan: str) -> list[torch.Tensor]:
    return _forward(key, hidden, weight, operands, budget_bytes)


@_shard_lm_head.register_fake
def _(key, hidden, weight, operands, budget_bytes, plan):
    backward_plan(hidden.device, hidden.dtype, plan)  # (its one-time probe at compile time, not in a step)
    return _fake(key, hidden, weight, operands)


@torch.library.custom_op("chunked_logits::shard_lm_head_backward", mutates_args=())
def shard_lm_head_backward(key: str, hidden: torch.Tensor, weight: torch.Tensor,
                            operands: list[torch.Tensor], grads: list[torch.Tensor], budget_bytes: int,
                            need_hidden: bool, need_weight: bool,
                            plan: str) -> tuple[torch.Tensor, torch.Tensor]:
    n, budget_bytes = hidden.shape[0], resolve_budget(budget_bytes, hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    grad_weight = torch.empty_like(weight) if need_weight else weight.new_empty(0)

    def grad_of_tile(t0: int, t1: int, v0: int, v1: int) -> torch.Tensor:
        return stage_tile_grad(key, F.linear(hidden[t0:t1], weight[v0:v1]), operands, grads, n, t0, v0)
    with torch.no_grad():
        loops = backward_loops(plan, hidden)
        loops(hidden, weight, budget_bytes, grad_of_tile, grad_hidden if need_hidden else None,
              grad_weight if need_weight else None)
    return grad_hidden, grad_weight


@shard_lm_head_backward.register_fake
def _(key, hidden, weight, operands, grads, budget_bytes, need_hidden, need_weight, plan):
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0))


def _setup(ctx, inputs, output):
    args = save_inputs(ctx, _shard_lm_head, inputs)
    keep_result_specs(ctx, output)
    ctx.needs = {"need_hidden": args["hidden"].requires_grad, "need_weight": args["weight"].requires_grad}


def _backward(ctx, grads):
    args, _ = saved_inputs(ctx)
    incoming = grads_or_zeros(ctx, grads, args["hidden"].device)
    gh, gw = call_by_name(shard_lm_head_backward, args, grads=incoming, **ctx.needs)
    return grads_by_name(_shard_lm_head, ctx.lengths, hidden=gh if ctx.needs["need_hidden"] else None,
                         weight=gw if ctx.needs["need_weight"] else None)


_shard_lm_head.register_autograd(_backward, setup_context=_setup)


@emitted(("shard_lm_head", "shard_lm_head_backward"), CAPTURE_SAFE)
def shard_lm_head(key: str, differentiable: bool, budget_bytes: int, hidden: torch.Tensor,
                  weight: torch.Tensor, *operands: torch.Tensor, plan: str = "auto"):
    """The reductions of one stage of a rewritten vocab-parallel region whose logits shard
    is ``hidden @ weight.T`` (see the module doc); ``plan``: ``Config.lm_head_plan``."""
    if not differentiable:
        hidden, weight = hidden.detach(), weight.detach()
    operands = tuple(o.detach() for o in operands)
    return tuple(_shard_lm_head(key, hidden, weight, list(operands), budget_bytes, plan))
