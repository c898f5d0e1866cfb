"""The vocab-parallel one-pass loop keeping its logits shard for the backward
(``lm_head_plan="kept_logits"``): three GEMMs a step, not four or five.

Contract: ``shard_lm_head_stages_kept(plan, train, budget, h, w, *operands)`` returns what
:func:`~fx_passes.distributed.one_pass.shard_lm_head_stages` returns, with the same
values; its backward gives the same gradients, each element one FP32 sum rounded once,
without computing the logits again.  See NOTE [kept shard logits].
"""

# NOTE [kept shard logits]
# The one-pass loop (``one_pass``) keeps only per-row results, so its backward computes the
# shard's logits again: four ``[T, H] x [H, V / world]`` GEMMs a step with the forward's on
# CUDA / XPU ("gpu"), five elsewhere ("two_sweeps"), against stock's three.  With
# ``lm_head_plan="kept_logits"``, or ``"auto"`` on a GPU (``tiling.keeps_logits``: stock's
# stages keep FP32 copies of the shard beside its logits; as for the lm_head: NOTE [kept
# logits]; ``"gpu"`` forces the recomputing loops) the rewrite emits
# ``shard_lm_head_stages_kept`` for a one-pass call whose rows no mask leaves out (a masked
# call keeps its own loop, ``masked_stages``):
#
# * forward: per row chunk the logits GEMM writes into one model-precision
#   ``[T, V / world]`` buffer (stock's own logits shard), and the stages and their glue run
#   on those values (``one_pass._forward``: the same maths, the same collectives);
# * backward: per row chunk the stage with a gradient's vjp reads the kept logits and its
#   model-precision gradient goes in their place; then ``grad_hidden = g @ W_shard`` and
#   ``grad_weight = g.T @ h`` are one GEMM each over all rows, each element one FP32 sum
#   inside its GEMM, rounded once: no recompute, no FP32 sum, no collective.
#
# Memory: the model-precision logits shard from the forward to the backward (``2 T V /
# world`` bytes, stock's logits; not stock's FP32 copies).  Where no backward can read them
# (grad mode off, nothing requiring grad) the call is the plain one-pass call.  A second
# backward through the same forward (``retain_graph=True``) finds the host flag cleared by
# the first and computes the logits again (the same chunks' GEMMs) before it starts.  Both
# ops carry ``torch.Tag.cudagraph_unsafe``, as the one-pass ops do.

from __future__ import annotations

import dataclasses

import torch

from ..kernels.log_softmax.shard import stage_tile_grad
from ..kernels.ops.registry import CUDAGRAPH_UNSAFE, ONE_PASS_PLANS, UNSAFE, emitted
from . import one_pass

__all__ = ["shard_lm_head_stages_kept"]


@torch.library.custom_op("chunked_logits::shard_lm_head_stages_kept", mutates_args=(), tags=UNSAFE)
def _kept(name: str, hidden: torch.Tensor, weight: torch.Tensor, externals: list[torch.Tensor],
          budget_bytes: int, plan: str) -> list[torch.Tensor]:
    # -> the plan's outputs, the logits shard (model precision), a host flag (1: not yet overwritten)
    logits = hidden.new_empty(hidden.shape[0], weight.shape[0])
    got = one_pass._forward(name, hidden, weight, externals, budget_bytes, into=logits)
    return [*got, logits, torch.ones(1, dtype=torch.uint8)]


@_kept.register_fake
def _(name, hidden, weight, externals, budget_bytes, plan):
    return [*one_pass._fake(name, hidden, weight, externals, budget_bytes, plan),
            hidden.new_empty(hidden.shape[0], weight.shape[0]), torch.empty(1, dtype=torch.uint8)]


@dataclasses.dataclass(frozen=True)
class _Backward:
    """The backward op's inputs (its schema's names), unpacked from its flat edge."""
    name: str
    hidden: torch.Tensor
    weight: torch.Tensor
    operands: list[torch.Tensor]
    grads: list[torch.Tensor]
    budget_bytes: int
    needs: tuple[bool, bool]  # (grad_hidden, grad_weight)
    logits: torch.Tensor
    flag: torch.Tensor


def _grads(b: _Backward) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``hidden`` and of the weight shard from the kept logits, whose
    gradient it writes in their place (NOTE [kept shard logits])."""
    hidden, weight, logits = b.hidden, b.weight, b.logits
    key, n = ONE_PASS_PLANS[b.name].grad[0], hidden.shape[0]
    splits = one_pass._splits(b.name, hidden, weight, b.budget_bytes)  # (the forward's chunks)
    keep = torch.autograd._unsafe_preserve_version_counter
    with keep(logits), keep(b.flag), torch.no_grad():
        if not bool(b.flag.tolist()[0]):  # (host memory) a second backward: the first overwrote them
            for t0, t1 in splits:
                torch.mm(hidden[t0:t1], weight.t(), out=logits[t0:t1])
        for t0, t1 in splits:
            logits[t0:t1] = stage_tile_grad(key, logits[t0:t1], b.operands, b.grads, n, t0)
        g = logits  # the logits' gradient, model precision, where they were
        grad_hidden = torch.mm(g, weight) if b.needs[0] else hidden.new_empty(0)
        grad_weight = torch.mm(g.t(), hidden) if b.needs[1] else weight.new_empty(0)
        b.flag.zero_()
    return grad_hidden, grad_weight


@torch.library.custom_op("chunked_logits::shard_lm_head_stages_kept_backward", mutates_args=(), tags=UNSAFE)
def _kept_backward(name: str, hidden: torch.Tensor, weight: torch.Tensor, operands: list[torch.Tensor],
                   grads: list[torch.Tensor], budget_bytes: int, need_hidden: bool, need_weight: bool,
                   logits: torch.Tensor, flag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # (``logits`` and ``flag``, which this call's forward made and only it reads, are written
    # in place; their version counters are kept for a retained graph's second backward)
    return _grads(_Backward(name, hidden, weight, operands, grads, budget_bytes, (need_hidden, need_weight),
                            logits, flag))


@_kept_backward.register_fake
def _(name, hidden, weight, operands, grads, budget_bytes, need_hidden, need_weight, logits, flag):
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0))


def _setup(ctx, inputs, output):
    one_pass.save_for_stages(ctx, _kept, inputs, output, extra=2)  # (+ the kept logits, the flag)


def _backward(ctx, grads):
    return one_pass.stages_backward(ctx, grads, _kept, _kept_backward, ("logits", "flag"))


_kept.register_autograd(_backward, setup_context=_setup)


@emitted(("shard_lm_head_stages_kept", "shard_lm_head_stages_kept_backward"), CUDAGRAPH_UNSAFE)
def shard_lm_head_stages_kept(name: str, differentiable: bool, budget_bytes: int, hidden: torch.Tensor,
                              weight: torch.Tensor, *externals: torch.Tensor, plan: str = "kept_logits"):
    """:func:`~fx_passes.distributed.one_pass.shard_lm_head_stages` keeping the logits shard
    for the backward (NOTE [kept shard logits]); the plain one-pass call where no backward
    can read them."""
    if not (differentiable and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return one_pass.shard_lm_head_stages(name, differentiable, budget_bytes, hidden, weight, *externals,
                                             plan=plan)
    return tuple(_kept(name, hidden, weight, [e.detach() for e in externals], budget_bytes, plan)[:-2])
