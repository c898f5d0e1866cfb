"""``shard_lm_head_stages`` on the rows a mask leaves in the loss: the one-pass loop of a
vocab-parallel region (``distributed/one_pass.py``), GEMMs and the glue's collectives
included, run on the rows every rank's skip graph keeps.  See NOTE [vocab-parallel rows a
mask leaves out].
"""

# NOTE [vocab-parallel rows a mask leaves out]
# The call takes a skip graph ``skip(width, z, *operands) -> (bool [rows], fill_0, ..)``
# (``distributed/shard_mask.py``; ``z``: a row's logits bound, ``kernels/rows.logit_bounds``
# of each rank's weight shard, the largest over the ranks, agreed with one all-reduce
# that also finds whether every shard is as wide (else no row is left out); ``width``:
# the shard's columns; one fill per result of the plan, the value a skipped row's result
# is written as).  Each rank evaluates it on its own shard, then
# the skip vectors are all-reduced with MIN over the plan's groups before the one host
# read (``rows.select``): a row is left out only where every rank proved it may be, and
# the kept count, so the row chunks and the collectives inside the loop, are the same on
# every rank.  A proof that reads another rank's value (an all-reduced sum is at least 1
# because the rank holding the row's max adds ``exp(0)``) assumes the other ranks' own
# facts, which their skip vectors hold: the MIN makes that sound.
#
# Forward: the loop runs on the kept rows (their hidden states and per-row operands
# gathered once); each result is its fill on the skipped rows, the loop's value on the
# others.  Backward (the stage with a gradient, ``shard_lm_head_backward``): the kept
# rows only, the skipped rows' hidden-state gradients exact zeros, where every skipped
# row's incoming cotangent is exactly 0 (what the skip graph proved for a finite incoming
# gradient).  Where one is not (an infinite incoming gradient times a mask's 0 is NaN,
# and stock's gradients turn NaN with it), every rank runs the forward again on every
# row (the stage operands of the skipped rows were never computed) and the backward on
# every row, as stock, so stock's NaN pattern is the body's own; the ranks agree on that
# with one all-reduce (MAX) of a flag, so their loops stay matched.  The flag, the count
# handed to the backward and the skipped cotangents are host memory on a CPU, so the call
# compacts on CPUs only; on another device it runs every row.  The op is
# ``cudagraph_unsafe`` (a host tensor, host reads).

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..kernels import rows as rows_of
from ..kernels.log_softmax.shard import shard_lm_head_backward
from ..kernels.ops import user_bodies
from ..kernels.ops.registry import CUDAGRAPH_UNSAFE, ONE_PASS_PLANS, UNSAFE, emitted
from . import one_pass

__all__ = ["shard_lm_head_stages_masked"]

HOST = torch.device("cpu")
F64 = torch.float64


def _all_reduce(x: torch.Tensor, op: str, groups: tuple[str, ...]) -> torch.Tensor:
    """``x`` all-reduced with ``op`` over each of ``groups`` in turn (functional collectives)."""
    collectives = torch.ops._c10d_functional
    for group in groups:
        x = collectives.wait_tensor(collectives.all_reduce(x, op, group))
    return x


def _per_row(t: torch.Tensor, n: int) -> bool:
    return t.dim() > 0 and t.shape[0] == n and t.numel() == n


def _take(values: list[torch.Tensor], rows: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``values`` at ``rows``: the per-row ones gathered, the others as they are."""
    return [v[rows] if _per_row(v, n) else v for v in values]


def _kept_rows(name: str, hidden: torch.Tensor, weight: torch.Tensor, mask_key: str,
               operands: list[torch.Tensor]) -> tuple[Optional[torch.Tensor], list[torch.Tensor]]:
    """(the rows to run, ascending, None for every row; each result's value on a skipped
    row): the skip graph ``mask_key`` on this rank's inputs, agreed over the plan's groups
    (module NOTE)."""
    n = hidden.shape[0]
    if not mask_key or hidden.device.type != "cpu" or n == 0:
        return None, []
    groups = ONE_PASS_PLANS[name].groups
    # (agreed with one all-reduce: each row's bound, the largest over the ranks, so every
    # rank bounds its logits alike (a bound that is not finite is inf before the MAX); the
    # widest and the narrowest shard, where alone the proof's intervals are every rank's)
    z = rows_of.logit_bounds(hidden, weight, None, None, False, "")
    width = torch.full((), float(weight.shape[0]), dtype=F64, device=hidden.device)
    mine = torch.cat([torch.where(torch.isfinite(z), z, torch.inf), width.reshape(1), -width.reshape(1)])
    agreed = _all_reduce(mine, "max", groups)
    z, same_width = agreed[:n], agreed[n] == -agreed[n + 1]
    skip, *fills = user_bodies.function(mask_key)(width, z, *operands)
    skip = skip.expand(n) & same_width
    return rows_of.select(_all_reduce(skip.to(torch.int32), "min", groups).bool()), fills


def _forward(name: str, hidden, weight, externals, budget_bytes: int, mask_key: str,
             operands: list[torch.Tensor]) -> list[torch.Tensor]:
    n = hidden.shape[0]
    kept, fills = _kept_rows(name, hidden, weight, mask_key, operands)
    if kept is None:
        got = one_pass._forward(name, hidden, weight, externals, budget_bytes)
        return [*got, torch.arange(n, device=hidden.device), torch.tensor(n, device=HOST)]
    if kept.shape[0] == 0:  # (every row left out, on every rank alike: one runs, for the results' shapes)
        kept = torch.zeros(1, dtype=torch.int64, device=hidden.device)
    got = one_pass._forward(name, hidden[kept], weight, _take(externals, kept, n), budget_bytes)
    results = []
    for r, fill in zip(got, fills):
        column = torch.as_tensor(fill, device=r.device).to(r.dtype).reshape(-1, *[1] * (r.dim() - 1))
        column = column.expand(n, *r.shape[1:]).contiguous()
        results.append(column.index_copy_(0, kept, r))
    index_run = kept.new_zeros(n)
    index_run[:kept.shape[0]] = kept
    return [*results, index_run, torch.tensor(kept.shape[0], device=HOST)]


@torch.library.custom_op("chunked_logits::shard_lm_head_stages_masked", mutates_args=(), tags=UNSAFE)
def _masked(name: str, hidden: torch.Tensor, weight: torch.Tensor, externals: list[torch.Tensor],
            budget_bytes: int, mask_key: str, operands: list[torch.Tensor], plan: str) -> list[torch.Tensor]:
    # -> the plan's outputs, the rows run (``[N]``, first ``count``), count (0-d, host memory)
    return _forward(name, hidden, weight, externals, budget_bytes, mask_key, operands)


@_masked.register_fake
def _(name, hidden, weight, externals, budget_bytes, mask_key, operands, plan):
    n = hidden.shape[0]
    return [*one_pass._fake(name, hidden, weight, externals, budget_bytes, plan),
            hidden.new_empty(n, dtype=torch.int64), hidden.new_empty((), dtype=torch.int64, device=HOST)]


@dataclasses.dataclass(frozen=True)
class _Backward:
    """The backward op's inputs (its schema's names): the op's flat edge, whose schema
    torch.library needs flat (``kernels/ops/args.py``), unpacks into this and calls on."""
    name: str
    hidden: torch.Tensor
    weight: torch.Tensor
    externals: list[torch.Tensor]
    operands: list[torch.Tensor]
    grads: list[torch.Tensor]
    budget_bytes: int
    need_hidden: bool
    need_weight: bool
    plan: str

    def stage(self, hidden, operands, grads) -> tuple[torch.Tensor, torch.Tensor]:
        """The stage with a gradient's backward on ``hidden``'s rows."""
        key, _, _ = ONE_PASS_PLANS[self.name].grad
        return shard_lm_head_backward(key, hidden, self.weight, operands, grads, self.budget_bytes,
                                      self.need_hidden, self.need_weight, self.plan)


def _backward_rows(b: _Backward, kept: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The stage with a gradient's backward on the rows the forward ran, or on every row
    where a skipped row's incoming cotangent is not 0 (module NOTE)."""
    hidden = b.hidden
    n, k = hidden.shape[0], int(count.tolist())  # (host memory: no op, no device sync)
    run = kept[:k]
    if k < n:
        skipped = torch.ones(n, dtype=torch.bool, device=hidden.device)
        skipped[run] = False
        nonzero = any(bool((g.reshape(n, -1)[skipped] != 0).any()) for g in b.grads)  # (host memory)
        again = _all_reduce(torch.tensor([int(nonzero)], device=hidden.device), "max",
                            ONE_PASS_PLANS[b.name].groups)
        if bool(again.item()):  # (host memory on a CPU, where alone the forward compacts)
            outs = one_pass._forward(b.name, hidden, b.weight, b.externals, b.budget_bytes)
            operands = [outs[i] if o is None else o for i, o in _grad_operands(b.name, b.externals)]
            return b.stage(hidden, operands, b.grads)
    if k == n:
        return b.stage(hidden, b.operands, b.grads)
    gh, gw = b.stage(hidden[run], _take(b.operands, run, n), _take(b.grads, run, n))
    if b.need_hidden:
        gh = hidden.new_zeros(hidden.shape).index_copy_(0, run, gh)
    return gh, gw


def _grad_operands(name: str, externals: list[torch.Tensor]) -> list[tuple[int, Optional[torch.Tensor]]]:
    """The stage with a gradient's operands: ``(i, None)`` for the plan's output ``i``,
    ``(-1, t)`` for an external ``t``."""
    _, where, _ = ONE_PASS_PLANS[name].grad
    return [(i, None) if kind == "out" else (-1, externals[i]) for kind, i in where]


@torch.library.custom_op("chunked_logits::shard_lm_head_stages_masked_backward", mutates_args=(), tags=UNSAFE)
def _masked_backward(name: str, hidden: torch.Tensor, weight: torch.Tensor, externals: list[torch.Tensor],
                     operands: list[torch.Tensor], grads: list[torch.Tensor], budget_bytes: int,
                     need_hidden: bool, need_weight: bool, kept: torch.Tensor,
                     count: torch.Tensor, plan: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward_rows(_Backward(name, hidden, weight, externals, operands, grads, budget_bytes,
                                    need_hidden, need_weight, plan), kept, count)


@_masked_backward.register_fake
def _(name, hidden, weight, externals, operands, grads, budget_bytes, need_hidden, need_weight, kept, count,
      plan):
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0))


def _setup(ctx, inputs, output):
    one_pass.save_for_stages(ctx, _masked, inputs, output, extra=2)  # (+ the rows run, their count)


def _backward(ctx, grads):
    return one_pass.stages_backward(ctx, grads, _masked, _masked_backward, ("kept", "count"))


_masked.register_autograd(_backward, setup_context=_setup)


@emitted(("shard_lm_head_stages_masked", "shard_lm_head_stages_masked_backward"), CUDAGRAPH_UNSAFE)
def shard_lm_head_stages_masked(name: str, differentiable: bool, budget_bytes: int, hidden: torch.Tensor,
                                weight: torch.Tensor, *externals: torch.Tensor, mask_key: str,
                                mask_operands, plan: str = "auto") -> tuple[torch.Tensor, ...]:
    """:func:`~fx_passes.distributed.one_pass.shard_lm_head_stages` on the rows the skip
    graph ``mask_key`` (on ``mask_operands``) cannot leave out, on every rank alike (NOTE
    [vocab-parallel rows a mask leaves out])."""
    if not differentiable:
        hidden, weight = hidden.detach(), weight.detach()
    out = _masked(name, hidden, weight, [e.detach() for e in externals], budget_bytes, mask_key,
                  [o.detach() for o in mask_operands], plan)
    return tuple(out[:-2])
