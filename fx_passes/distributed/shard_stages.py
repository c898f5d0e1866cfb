"""Vocab-parallel regions: row reductions over this rank's vocabulary shard, combined
across ranks by functional collectives.

The pass takes only the FP32 ``[.., V / world]`` part of such a graph (the upcast,
elementwise ops with per-row or scalar operands, and the reductions over the last dim)
and leaves everything on ``[rows]`` (the collectives, ``log``, the loss) as written.  Each
*stage* (reductions whose per-row operands are ready at the same time) becomes one
:func:`shard_reduce` call, which recomputes the elementwise ops from the model-precision
logits and writes the logits gradient in model precision: no FP32 ``[.., V / world]``
tensor, and a local backward.  See NOTE [vocab-parallel stages].
"""

# NOTE [vocab-parallel stages]
# Megatron-style code (each rank holds the logits of its vocabulary shard, ``[.., V / world]``)
# computes a log-softmax in stages: the local row max, an all-reduce of it, the local
# sum of ``exp(z - max)`` and the target logit, all-reduces of those ``[rows]`` tensors,
# then ``log`` / ``-`` on ``[rows]``.  Each stage reads the FP32 upcast of the local
# logits; stock autograd keeps FP32 ``[.., V / world]`` tensors for the backward and
# writes its gradient through FP32 ``[.., V / world]`` buffers.
#
# The pass does not need to know the collectives: it takes the FP32 ``[.., V]`` part of
# the graph only (the upcast, elementwise ops on it with per-row or scalar operands, and
# the reductions over the last dim that end it) and leaves everything on ``[rows]``
# (the collectives, ``log``, the loss) as the user wrote it.  Each *stage* (the
# reductions whose per-row operands are ready at the same time) becomes one call of
# :func:`shard_reduce`, which recomputes the elementwise ops from the model-precision
# logits inside its reductions and, in the backward, writes the logits gradient in model
# precision in one pass (``torch.autograd.grad`` of the same ops on the saved
# model-precision logits).  So the result is the user's own maths, gradient semantics of
# their collectives included, with no FP32 ``[.., V / world]`` tensor anywhere; the
# backward is local (no collective is added).
#
# Before (one stage shown)::
#
#     z   = local.float() / t
#     m   = wait_tensor(all_reduce(z.detach().amax(-1), "max", group))
#     zs  = z - m.unsqueeze(-1)
#     s   = zs.exp().sum(-1)                       # -> all_reduce ...
#     tgt = zs.gather(-1, idx)                     # -> where(own, ..) -> all_reduce ...
#
# After::
#
#     amax  = shard_reduce("<key0>", False, local)[0]
#     m     = wait_tensor(all_reduce(amax, "max", group))
#     out   = shard_reduce("<key1>", True, local, m.unsqueeze(-1), idx)
#     s, tgt = out[0], out[1]
#
# A gather becomes ``where(arange(V) == idx, zs, 0).sum(-1)`` inside the call: the same
# value, and a backward that is pointwise (a gather's backward scatters into a zeros
# ``[.., V]`` buffer).

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.fx import Graph, GraphModule, Node

from ..config import Config
from ..fx.graph_ops import (
    get_arg,
    is_collective,
    is_low_precision,
    is_scalar,
    meta,
    op_name,
    requires_grad,
    scalar_tensor,
)
from ..fx.placement import changes_state, first_mutation, mutation_of, same_state
from ..kernels.log_softmax.shard import gather_index_positions, shard_lm_head
from ..kernels.ops import user_bodies
from ..kernels.tiling import keeps_logits
from ..match.lm_head import LMHead, producer
from ..match.loss_tail import match_region_reads
from ..match.masks import mask_read
from ..reporting.outcome import LMHead as LMHeadOutcome
from ..reporting.outcome import Outcome
from ..reporting.report import Decline, Reason
from ..rewrite.skip_rows import _masked_call
from .kept_stages import shard_lm_head_stages_kept
from .masked_stages import shard_lm_head_stages_masked
from .one_pass import getitems, plan_one_pass, shard_lm_head_stages
from .one_pass import register as register_one_pass
from .shard_mask import StagesView, skip_rows_of_stages, view_of
from .shard_reduce import _build, shard_reduce
from .shard_regions import (
    ShardRegion,
    ancestors,
    cone,
    find_shard_regions,
    needs_grad,
    numel,
    operands_of,
    reduction_kind,
)

__all__ = ["find_shard_regions", "rewrite_shard_region", "ShardRegion"]


def _reduction_copy(n: Node, region: ShardRegion) -> bool:
    """Megatron's in-place all-reduce of a stage result: ``m.copy_(...)`` into a reduction
    (or a collective): it changes no operand of the lm_head."""
    return is_collective(n) or (n.op == "call_method" and n.target == "copy_" and bool(n.args)
                                and n.args[0] in region.reductions)


def _fusable_lm_head(region: ShardRegion) -> tuple[Optional[LMHead], str]:
    """The lm_head matmul that makes the shard, when every stage can compute it per
    chunk (:mod:`fx_passes.kernels.log_softmax.shard`); else None and why not."""
    head = producer(region.x) if isinstance(region.x, Node) else None
    if head is None:
        return None, ""  # no matmul: nothing to say
    if head.bias is not None:
        return None, "the lm_head has a bias"
    if set(region.x.users) != {region.upcast}:
        return None, "the logits shard is also read outside the region"
    # the loop computes the matmul again at each stage and in the backward: nothing may
    # change the operands from the matmul to the last stage (placement's rule), nor after
    # it when the loop saves them for its backward
    graph = region.x.graph
    first = head.transpose if head.transpose is not None else head.logits
    changed = first_mutation(graph, first, region.reductions[-1], lambda n: _reduction_copy(n, region))
    if changed is None and requires_grad(region.x):
        changed = mutation_of(graph, [head.hidden, head.weight], region.reductions[-1])
    if changed is not None:
        return None, f"{changed.name} ({changed.target}) may change the lm_head's operands after its matmul"
    try:
        same_state(region.x.graph, [region.upcast, head.logits, *filter(None, [head.transpose])])
    except Decline as d:
        return None, d.detail
    x, h, w = meta(region.x), meta(head.hidden), meta(head.weight)
    if not (isinstance(h, torch.Tensor) and isinstance(w, torch.Tensor) and x.dim() == 2 and h.dim() == 2
            and w.dim() == 2 and h.dtype == w.dtype == x.dtype and is_low_precision(region.x)):
        return None, "the shard is not a model-precision [T, H] x [V / world, H] matmul"
    for stage in region.stages:
        operands = operands_of(region, [n for r in stage for n in cone(region, r)])
        if any(requires_grad(o) for o in operands):
            return None, "a stage's per-row operand needs a gradient"
        if any(needs_grad(r) for r in stage) and {reduction_kind(r) for r in stage} - {"sum", "gather"}:
            return None, "the stage with a gradient has a reduction other than sum and gather"
    return head, ""


def _index_positions(region: ShardRegion, reductions: list[Node], operands: list[Node]) -> tuple[int, ...]:
    """The operands that are a gather's index and read by nothing else in the stage."""
    nodes = {n for r in reductions for n in cone(region, r)}
    out = []
    for r in reductions:
        if reduction_kind(r) == "gather":
            index = get_arg(r, "index")
            if any(index in n.all_input_nodes for n in nodes if n is not r):
                raise Decline(Reason.UNKNOWN_OP, f"the gather index {index.name} is read elsewhere too")
            out.append(operands.index(index))
    return tuple(out)


class _Stage(NamedTuple):
    """One stage, planned: its reductions, per-row operands, the nodes to move before its
    first reduction, whether it needs a gradient, its body, its gather indexes' positions."""
    reductions: list[Node]
    operands: list[Node]
    late: list[Node]
    differentiable: bool
    body: GraphModule
    indexes: tuple[int, ...]


def _late(region: ShardRegion, operands: list[Node], anchor: Node, order: dict[Node, int]) -> list[Node]:
    """The nodes to move before ``anchor`` so that ``operands`` exist there (graph
    order); Decline if one of them cannot move (a region node, a collective, a mutation)."""
    inside = set(region.nodes) | set(region.reductions)
    late: set[Node] = set()
    for o in operands:
        if order[o] > order[anchor]:
            late |= {a for a in ancestors(o, set()) if order[a] > order[anchor]} | {o}
    for n in late:
        if n in inside or is_collective(n) or changes_state(n):
            raise Decline(Reason.ORDER, f"operand {n.name} is computed after the first reduction")
    if late:  # moved before the anchor: across no in-place change (placement's rule)
        changed = first_mutation(anchor.graph, anchor, max(late, key=order.__getitem__),
                                 lambda n: _reduction_copy(n, region))
        if changed is not None:
            raise Decline(Reason.MUTATION, f"{changed.name} ({changed.target}) runs before operand "
                          f"{max(late, key=order.__getitem__).name}, which the rewrite reads earlier")
    return sorted(late, key=order.__getitem__)


def rewrite_shard_region(graph: Graph, region: ShardRegion, config: Config) -> Outcome:
    """One :func:`shard_reduce` call per stage (:func:`shard_lm_head` when the shard is a
    fusable lm_head matmul and ``config.fuse_lm_head``; one :func:`shard_lm_head_stages`
    call for all stages when their glue allows, :mod:`fx_passes.distributed.one_pass`); the
    FP32 ``[.., V]`` nodes erased.  Plans every stage (Decline) before it edits the graph.
    Returns what became of the lm_head matmul and of the one pass."""
    fuse_lm_head, budget_bytes = config.fuse_lm_head, config.device_budget_bytes
    mask = mask_read(region.reductions, frozenset(region.nodes) | set(region.reductions)) \
        if config.skip_masked_rows else None
    rows_why = (f"the loss reads {mask.name}, a mask, but these vocab-parallel stages run every row "
                "(only the one-pass loop of a fused lm_head skips rows)",) if mask is not None else ()
    head, why = _fusable_lm_head(region) if fuse_lm_head else (None, "")
    order = {n: i for i, n in enumerate(graph.nodes)}
    plans = []
    for reductions in region.stages:
        operands = operands_of(region, [n for r in reductions for n in cone(region, r)])
        late = _late(region, operands, reductions[0], order)
        indexes: tuple[int, ...] = ()
        if head is not None:
            try:
                indexes = _index_positions(region, reductions, operands)
            except Decline as d:
                head, why = None, d.detail
        plans.append(_Stage(reductions, operands, late, any(needs_grad(r) for r in reductions),
                            _build(region, reductions, operands), indexes))
    one, one_pass_why = _one_pass(region, plans, order) if head is not None and len(plans) > 1 else (None, "")
    view = None
    if one is not None:
        if mask is not None:  # (what the skip graph reads of the stages, before the edit erases them)
            rows = numel(tuple(meta(region.upcast).shape[:-1]))
            view = view_of(one[0], plans, rows, (meta(head.hidden).dtype, meta(head.weight).shape[0]))
        call = _rewrite_one_pass(graph, region, plans, one, head, budget_bytes, config.lm_head_plan)
    else:
        _rewrite_stages(graph, region, plans, head, budget_bytes, config.lm_head_plan)
    for n in reversed(list(graph.nodes)):
        if (n in region.reductions or n in region.nodes) and not n.users:
            graph.erase_node(n)
    masked = 0
    if view is not None:
        said: list[str] = []
        masked = int(_skip_masked_rows(graph, call, view, said))
        rows_why = () if masked else tuple(said[:1]) or rows_why
    # (NOTE [kept shard logits]: asked for, or "auto" on a GPU, tiling.keeps_logits: stock's
    # stages keep FP32 copies of the shard beside its logits; a masked call keeps its own loop)
    kept = one is not None and call.target is shard_lm_head_stages and \
        keeps_logits(meta(head.hidden).device.type, True, config.lm_head_plan)
    if kept:
        call.target = shard_lm_head_stages_kept
    if head is None:
        return Outcome.not_fused(why, rows_why=rows_why)
    for n in (region.x, head.transpose):
        if n is not None and not n.users:
            graph.erase_node(n)
    one_pass = None if len(plans) < 2 else one is not None
    return Outcome(LMHeadOutcome.FUSED, one_pass=one_pass, one_pass_why=one_pass_why, rows_why=rows_why,
                   masked_per_token=masked, kept_logits=int(kept))


def _skip_masked_rows(graph: Graph, call: Node, view: StagesView, why: list[str]) -> bool:
    """Make the one-pass call ``call`` ``shard_lm_head_stages_masked`` with the skip graph of
    its stages and readers (``distributed/shard_mask.py``); False where it has none (the
    reason appended to ``why``)."""
    device = getattr(meta(call.args[3]), "device", None)
    if device is not None and device.type != "cpu":  # (NOTE [vocab-parallel rows a mask leaves out])
        why.append(f"on {device.type} this call runs every row: its backward would read the skipped rows' "
                   "cotangents and the count from the device, two more syncs a step")
        return False

    view.externals = list(call.args[5:])  # (a number among them: its 0-d tensor, as the call reads it)

    def find(said: list[str]):
        tail = match_region_reads(graph, call, len(view.outputs), collectives=True)
        glue = list(view.glue.graph.nodes) if view.glue is not None else []
        # (the groups of the loop's collectives: the op agrees its skip vector over them)
        return skip_rows_of_stages(view, tail, _group_sizes(glue), said)
    return _masked_call(graph, call, find, shard_lm_head_stages_masked, why, masked=True)


def _group_sizes(nodes: list[Node]) -> dict[str, int]:
    """The size of each process group an all-reduce of ``nodes`` names (by name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    sizes = {}
    for n in nodes:
        if is_collective(n) and op_name(n).split(".")[0] == "all_reduce" and len(n.args) == 3 \
                and isinstance(n.args[2], str) and n.args[2] not in sizes:
            try:
                sizes[n.args[2]] = _resolve_process_group(n.args[2]).size()
            except (RuntimeError, ValueError, KeyError):  # (not a group of this process: no size, no rule)
                continue
    return sizes


def _one_pass(region: ShardRegion, plans: list, order: dict[Node, int]):
    """(the one-pass plan and what to move before the first stage, ""), or (None, why not)."""
    rows = numel(tuple(meta(region.upcast).shape[:-1]))
    try:
        one = plan_one_pass(region, [(p.reductions, p.operands) for p in plans], rows, order)
        late = _late(region, one.externals, plans[0].reductions[0], order)
    except Decline as d:
        return None, d.detail
    return (one, late), ""


def _rewrite_stages(graph: Graph, region: ShardRegion, plans: list[_Stage], head: Optional[LMHead],
                    budget_bytes: int, lm_head_plan: str) -> None:
    for p in plans:
        anchor = p.reductions[0]
        for n in p.late:
            anchor.prepend(n)
        key = user_bodies.register(p.body)
        with graph.inserting_before(anchor):
            operands = [scalar_tensor(graph, o, region.x) if is_scalar(o) else o for o in p.operands]
        if head is not None:
            gather_index_positions(key, p.indexes)
            args = (shard_lm_head, (key, p.differentiable, budget_bytes, head.hidden, head.weight, *operands),
                    {"plan": lm_head_plan})
        else:
            args = (shard_reduce, (key, p.differentiable, region.x, *operands))
        with graph.inserting_before(anchor):
            getitems(graph, graph.call_function(*args), p.reductions)


def _rewrite_one_pass(graph: Graph, region: ShardRegion, plans: list[_Stage], planned, head: LMHead,
                      budget_bytes: int, lm_head_plan: str) -> Node:
    one, late = planned
    anchor = plans[0].reductions[0]
    for n in late:
        anchor.prepend(n)
    keys = []
    for p in plans:
        keys.append(user_bodies.register(p.body))
        gather_index_positions(keys[-1], p.indexes)
    name = register_one_pass(one, [p.reductions for p in plans], keys)
    differentiable = any(p.differentiable for p in plans)
    with graph.inserting_before(anchor):
        externals = [scalar_tensor(graph, o, head.hidden) if is_scalar(o) else o for o in one.externals]
        call = graph.call_function(shard_lm_head_stages, (name, differentiable, budget_bytes, head.hidden,
                                                          head.weight, *externals), {"plan": lm_head_plan})
        getitems(graph, call, one.outputs)
    for n in reversed(one.glue):
        if not n.users:
            graph.erase_node(n)
    return call
