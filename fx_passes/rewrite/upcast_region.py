"""Rewrite a matched region into one call of :func:`fx_passes.kernels.log_softmax.given.row_stats`.

Before (what users write; Dynamo graph)::

    float_1 = logits.float()
    truediv = float_1 / 0.7
    lp      = torch.log_softmax(truediv, dim=-1)
    gather  = lp.gather(-1, index)

After::

    squeeze = index.squeeze(-1)
    stats   = fx_passes.kernels.log_softmax.given.row_stats(logits, squeeze, 0.7, True, False)
    logprob = stats[1]
    gather  = logprob.unsqueeze(-1)

The FP32 views between the upcast and the reductions are replayed on the
model-precision logits (``reshape`` instead of ``view``, since the logits may be a
strided slice), so the only tensors of size ``[.., V]`` left are model precision.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch
from torch.fx import Graph, Node

from ..config import Config
from ..fx.emitter import Emitter
from ..fx.graph_ops import canon, get_arg, meta, requires_grad
from ..fx.placement import check_placement, movable_before
from ..kernels.log_softmax.given import row_stats
from ..kernels.log_softmax.lm_head import lm_head_row_stats
from ..match.lm_head import FUSION_OFF, LMHead, match_lm_head
from ..match.upcast_regions import Region, Role
from ..reporting.outcome import LMHead as LMHeadOutcome
from ..reporting.outcome import Outcome
from ..reporting.report import Decline, Reason

__all__ = ["rewrite_region", "plan_rewrite", "fp32_bytes"]


def fp32_bytes(node: Node) -> int:
    """Bytes of the FP32 tensor of ``node``'s shape a rewrite no longer materialises (0 if symbolic)."""
    numel = meta(node).numel()
    return 4 * numel if isinstance(numel, int) else 0


def _replay_view(e: Emitter, view: Node, src: Node, on_hidden: bool = False) -> Node:
    """``view`` applied to ``src`` (the logits, or the lm_head's hidden states, where a
    flatten to ``[N, V]`` becomes a flatten to ``[N, H]``)."""
    op = canon(view)
    if on_hidden and op in ("reshape", "flatten"):
        return e.function(torch.flatten, src, 0, -2)
    if op == "getitem":
        return e.function(operator.getitem, src, get_arg(view, "index"))
    if op == "contiguous":
        return src
    if op == "flatten":
        return e.function(torch.flatten, src, get_arg(view, "start_dim", 0), get_arg(view, "end_dim", -1))
    # view / reshape: the shape is *args or one sequence argument
    shape = view.args[1:] if view.op == "call_method" else get_arg(view, "shape")
    if len(shape) == 1 and isinstance(shape[0], (list, tuple)):
        shape = shape[0]
    if "shape" in view.kwargs:
        shape = view.kwargs["shape"]
    return e.function(torch.reshape, src, tuple(shape))


def _late_index_nodes(graph: Graph, region: Region, anchor: Node) -> list[Node]:
    """The index node and its ancestors defined after ``anchor``, in graph order: moved
    before it by the rule of ``fx/placement.movable_before``; Decline where they cannot."""
    if region.index is None:
        return []
    moved = movable_before(graph, anchor, [region.index], frozenset(region.roles))
    if isinstance(moved, str):
        raise Decline(Reason.ORDER, f"{region.index.name}, computed after {anchor.name}, cannot move before "
                                    f"it: {moved}")
    return moved


def emit_stats(e: Emitter, region: Region, xv: Node, tokens: Node | None, config: Config,
               lm_head: LMHead | None) -> Node:
    """The node computing ``(lse, logprob, entropy)`` for the region's rows: from the
    model-precision logits ``xv``, or from the lm_head's hidden states ``xv``."""
    if lm_head is not None:
        returned = (lm_head.hidden,) if lm_head.returned else ()  # the logits' shape: the 4th result's
        return e.function(lm_head_row_stats, xv, lm_head.weight, lm_head.bias, tokens, region.scale,
                          region.scale_is_div, region.want_entropy, config.device_budget_bytes,
                          lm_head.transforms, config.lm_head_plan, *returned)
    return e.function(row_stats, xv, tokens, region.scale, region.scale_is_div, region.want_entropy)


@dataclasses.dataclass
class _Plan:
    """What the edit does, decided before it starts."""

    order: dict[Node, int]  # graph order before the edit
    anchor: Node  # the new nodes go before it: the first sink
    late: list[Node]  # what the token indices need, defined after the anchor: hoisted
    lm_head: Optional[LMHead]  # the matmul computed inside the chunk loop, if fused
    detach: set[Node]  # results the original computed under no_grad (placement.check_placement)
    why: str  # why the logits are read whole ("" when there is nothing to say)
    loss: bool  # the region has loss sinks: the index holds labels, some maybe ignored
    ignore_index: Any  # the loss sinks' ignore_index (one for all of them)


def plan_rewrite(graph: Graph, region: Region, config: Config) -> _Plan:
    """Every check of the rewrite: raises Decline, and touches nothing."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = min((s.node for s in region.sinks), key=order.__getitem__)
    late = _late_index_nodes(graph, region, anchor)
    # The rewrite reads x, the temperature and the token indices at the anchor, where the
    # graph read them anywhere from the first to the last region node (fx_passes.fx.placement).
    absorbed = [*region.roles, *([region.moved_scale] if region.moved_scale else [])]
    results = [s.node for s in region.sinks]
    last = max([*absorbed, *late], key=order.__getitem__)
    inputs = [region.x, region.scale]
    # (the upcast saves nothing for the backward; row_stats saves x)
    saved = [region.x] if requires_grad(region.x) else []
    detach = check_placement(graph, absorbed, anchor, results, inputs, last, saved)
    loss_sinks = [s for s in region.sinks if s.role == Role.LOSS]
    ignore = loss_sinks[0].ignore_index if loss_sinks else None
    if any(s.ignore_index != ignore for s in loss_sinks):
        raise Decline(Reason.LOSS_OPTIONS, "losses with different ignore_index")
    lm_head, why = match_lm_head(region) if config.fuse_lm_head else (None, FUSION_OFF)
    if lm_head is not None:  # the loop also computes the matmul at the anchor: the same rule from there
        head_nodes = [lm_head.logits, *lm_head.chain, *lm_head.views, *filter(None, [lm_head.transpose])]
        try:
            operands = [o for o in (lm_head.hidden, lm_head.weight, lm_head.bias) if o is not None]
            detach = check_placement(graph, [*absorbed, *head_nodes], anchor,
                                     results + ([region.x] if lm_head.returned else []),
                                     [*operands, region.scale], last,
                                     operands if requires_grad(region.x) else [])
        except Decline as d:
            lm_head, why = None, f"{d.reason.name}: {d.detail}"
    return _Plan(order=order, anchor=anchor, late=late, lm_head=lm_head, detach=detach, why=why,
                 loss=bool(loss_sinks), ignore_index=ignore)


def rewrite_region(graph: Graph, region: Region, config: Config) -> Outcome:
    """Replace the region's nodes; raises Decline before touching the graph if it can't.
    Returns what became of the lm_head matmul."""
    plan = plan_rewrite(graph, region, config)  # the only place that declines
    for n in plan.late:  # hoist what the token indices need to before the anchor
        plan.anchor.prepend(n)
    e = Emitter(graph, plan.anchor)
    lm_head = plan.lm_head
    xv = lm_head.hidden if lm_head else region.x
    for view in lm_head.views if lm_head else ():  # (h @ w.T)[:, :-1] is h[:, :-1] @ w.T
        xv = _replay_view(e, view, xv)
    twins: dict[Node, Node] = {region.upcast: xv}
    for view in region.views:
        xv = _replay_view(e, view, xv, on_hidden=lm_head is not None)
        twins[view] = xv
    tokens, valid = _emit_tokens(e, region, plan)
    stats = emit_stats(e, region, xv, tokens, config, lm_head)
    _replace_sinks(e, region, stats, valid, plan.detach)
    if lm_head is not None and lm_head.returned:  # the graph output reads the loop's logits
        logits = e.function(operator.getitem, stats, 3)
        if region.x in plan.detach:
            logits = e.method("detach", logits)
        for user in [u for u in region.x.users if u.op == "output"]:
            user.replace_input_with(region.x, logits)
    for user, fp32_node in region.meta_users:
        if user not in region.roles:
            user.replace_input_with(fp32_node, twins.get(fp32_node, xv))
    _erase_region(graph, region, plan)
    if lm_head is not None:
        return Outcome(LMHeadOutcome.FUSED, returns_logits=lm_head.returned)
    return Outcome.not_fused(plan.why)


def _emit_tokens(e: Emitter, region: Region, plan: _Plan) -> tuple[Node | None, Node | None]:
    """(token indices with one per row, the not-ignored mask of a loss, or None)."""
    if region.index is None:
        return None, None
    if not plan.loss and meta(region.index).dim() < meta(region.z).dim():  # L[arange(N), tok]: tok
        return region.index, None
    if not plan.loss:  # gather: the index without its trailing 1
        return _unsqueezed(region.index) or e.method("squeeze", region.index, -1), None
    valid = e.function(operator.ne, region.index, plan.ignore_index)
    return e.function(torch.where, valid, region.index, 0), valid


def _replace_sinks(e: Emitter, region: Region, stats: Node, valid: Node | None, detach: set[Node]) -> None:
    """Each per-row result of the region, computed from ``stats`` = (lse, logprob, entropy);
    detached where the original was computed under no_grad (``detach``)."""
    outputs: dict[int, Node] = {}

    def out(i: int) -> Node:  # stats[i], emitted once and only if used
        if i not in outputs:
            outputs[i] = e.function(operator.getitem, stats, i)
        return outputs[i]

    for sink in region.sinks:
        if sink.role == Role.LOGPROB:
            value = out(1) if sink.indexed else e.method("unsqueeze", out(1), -1)
        elif sink.role == Role.LSE:
            value = out(0)
        elif sink.role == Role.ENTROPY:
            value = out(2)
        elif sink.role == Role.NEG_ENTROPY:
            value = e.function(operator.neg, out(2))
        elif sink.role == Role.EXPECTED_Z:
            value = e.function(operator.sub, out(0), out(2))
        else:  # loss: -logprob on rows whose label is not ignored
            value = e.function(torch.where, valid, e.function(operator.neg, out(1)), 0.0)
            if sink.reduction != "none":
                value = e.method("sum", value)
            if sink.reduction == "mean":
                value = e.function(operator.truediv, value, e.method("sum", valid))
        if sink.keepdim:
            value = e.method("unsqueeze", value, -1)
        if sink.node in detach:
            value = e.method("detach", value)
        sink.node.replace_all_uses_with(value)


def _erase_region(graph: Graph, region: Region, plan: _Plan) -> None:
    """Erase the region's nodes (and the lm_head matmul, the token unsqueeze) now unused."""
    aranges = [get_arg(s.node, "index")[0] for s in region.sinks if s.indexed]  # (L[arange(N), tok])
    for node in sorted(region.roles, key=plan.order.__getitem__, reverse=True):
        graph.erase_node(node)
    for node in dict.fromkeys(aranges):
        if not node.users:
            graph.erase_node(node)
    if region.moved_scale is not None:
        graph.erase_node(region.moved_scale)
    if plan.lm_head is not None:
        for n in (*reversed(plan.lm_head.views), *reversed(plan.lm_head.chain), plan.lm_head.logits,
                  plan.lm_head.transpose):
            if n is not None and not n.users:
                graph.erase_node(n)
    index = region.index
    if index is not None and not index.users and canon(index) is None and _unsqueezed(index) is not None:
        graph.erase_node(index)  # the token unsqueeze only the gather read


def _unsqueezed(index: Node) -> Node | None:
    """``t`` when ``index`` is ``t.unsqueeze(-1)``: the tokens without the extra dim."""
    is_unsqueeze = (index.op == "call_method" and index.target == "unsqueeze") or (
        index.op == "call_function" and index.target is torch.unsqueeze)
    if not is_unsqueeze or len(index.args) != 2 or index.kwargs:
        return None
    src, dim = index.args
    if not isinstance(src, Node) or dim not in (-1, meta(index).dim() - 1):
        return None
    return src
