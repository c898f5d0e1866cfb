"""Gradients in the forward: a fused lm_head region and its loss tail become one call.

Before (after the region's rewrite, :mod:`fx_passes.rewrite.upcast_region`)::

    stats   = lm_head_row_stats(hidden, weight, None, tokens, None, True, False, ...)
    getitem = stats[1]
    mul     = getitem * advantages
    mean    = mul.mean()
    neg     = -mean

After::

    neg = lm_head_loss(hidden, weight, None, tokens, None, True, False, ..., 'two_sweeps',
                       '<tail key>', '<final key>', 'mean:float32', True, True, 1, advantages)

The tail (:mod:`fx_passes.match.loss_tail`) becomes two FX graphs in ``GRAPH_BODIES`` (the
row part ``tail``, the scalar part ``final``: :mod:`fx_passes.rewrite.tail_graphs`); the call
runs where the loss was (``fx/placement.check_placement``).  See NOTE [loss tail graphs].
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Optional

from torch._dynamo.utils import counters
from torch.fx import Graph, Node

from ..config import Config
from ..fx.emitter import Emitter
from ..fx.graph_ops import bound_args, is_scalar, keep_meta, meta, requires_grad, same, scalar_tensor
from ..fx.placement import check_placement
from ..kernels.log_softmax.lm_head import lm_head_row_stats
from ..kernels.log_softmax.lm_head_kept import KEPT, lm_head_row_stats_kept
from ..kernels.log_softmax.loss import PLANS, lm_head_loss
from ..kernels.ops import user_bodies
from ..kernels.ops.args import HeadOptions, LossOptions, head_of_node
from ..kernels.row_local.loss import row_bytes, row_local_loss
from ..kernels.row_local.split import Split, spec_of, split_of_spec
from ..kernels.tiling import backward_plan, holds_weight_sums, keeps_logits, weight_sums_why
from ..match.body_mask import skip_rows_of_body
from ..match.loss_tail import LossTail, NoTail, match_loss_tail, match_tail
from ..match.masks import masks_among
from ..match.row_mask import skip_rows_body
from ..reporting.outcome import LossInCall
from ..reporting.report import Decline, log, say_once
from .group_sums import committed, match_regrouped
from .tail_graphs import _bodies, _final, _joined, _kinds

__all__ = ["rewrite_loss_tail", "rewrite_row_loss_tail", "fused_calls", "GEMMS", "keep_logits"]

# model-precision-input GEMMs of one step, in units of [T, H] x [H, V], per plan (unit incoming gradient)
GEMMS = {"gpu": 3, "two_sweeps": 4}


def fused_calls(graph: Graph) -> set[Node]:
    """The fused lm_head calls of ``graph`` (each may have a loss tail)."""
    return {n for n in graph.nodes if n.op == "call_function" and n.target is lm_head_row_stats}


def _plan(tail: LossTail, stock_fp32: bool) -> str:
    """The plan the op runs (``tiling.backward_plan`` of the region's device and dtype);
    ``stock_fp32``: stock keeps the region's FP32 ``[T, V]`` (``_weight_sums_fit``)."""
    hidden, chosen = meta(head_of_node(tail.stats).hidden), HeadOptions.from_node(tail.stats).plan
    if chosen == KEPT:  # (the user's three GEMMs on stock's structure: NOTE [kept logits])
        raise NoTail("lm_head_plan='kept_logits': the per-token call keeps its logits for the backward")
    plan = backward_plan(hidden.device, hidden.dtype, chosen)
    if plan not in PLANS:
        raise NoTail(f"the {plan!r} plan computes no gradient in the forward")
    _weight_sums_fit(plan, hidden, meta(head_of_node(tail.stats).weight), stock_fp32)
    return plan


def keep_logits(call: Node, stock_fp32: bool = False) -> bool:
    """A per-token ``lm_head_row_stats`` call that returns no logits, of plan
    ``"kept_logits"`` or of ``"auto"`` where ``tiling.keeps_logits`` says so (a GPU, stock
    keeping the region's FP32 ``[T, V]``: ``stock_fp32``), runs ``lm_head_row_stats_kept``
    (NOTE [kept logits]; the same arguments) where a backward may read them (``hidden`` or
    ``weight`` requires grad).  True where it now does."""
    args = bound_args(call)
    if call.target is not lm_head_row_stats or args.get("returned_like") is not None or \
            not keeps_logits(meta(args["hidden"]).device.type, stock_fp32, args.get("plan", "auto")):
        return False
    if not (requires_grad(args["hidden"]) or requires_grad(args["weight"])):
        return False  # (no backward may read them: a scoring graph keeps nothing, and says so)
    if args.get("plan") != KEPT:
        say_once(logging.INFO, "chunked_logits: lm_head_plan 'auto' on %s: a per-token call keeps its "
                 "model-precision logits for the backward (three GEMMs a step; stock keeps an FP32 [T, V] "
                 "beside them); lm_head_plan='gpu' recomputes them instead (one GEMM more, less memory)",
                 meta(args["hidden"]).device.type)
    call.target = lm_head_row_stats_kept
    return True


def _weight_sums_fit(plan: str, hidden, weight, stock_fp32: bool = False, row_local: bool = False) -> None:
    """NoTail where the ``"gpu"`` loss would hold FP32 ``[V, H]`` sums at a peak above
    stock's (``tiling.holds_weight_sums``), said in the log and counted."""
    rows = math.prod(hidden.shape[:-1])
    rows = rows if isinstance(rows, int) else None
    (vocab, width), kind = weight.shape[-2:], hidden.device.type
    if plan == "gpu" and not holds_weight_sums(rows, int(vocab), int(width), kind, stock_fp32, row_local):
        why = weight_sums_why(rows, int(vocab), int(width), stock_fp32, row_local)
        say_once(logging.INFO, "chunked_logits: %s", why)
        counters["chunked_logits"]["weight_sums_over_stock"] += 1
        raise NoTail(why)


def _check(graph: Graph, tail: LossTail, head: list, saved: list) -> None:
    """The call may run at the loss: the lm_head's operands ``head`` (hidden, weight,
    bias) and ``saved``, the other tensors it saves for its backward, unchanged in place
    until then, one grad mode."""
    operands = [o for o in head if isinstance(o, Node)]
    detach = check_placement(graph, tail.nodes, tail.loss, [tail.loss],
                             [*operands, *tail.row_operands, *tail.whole], tail.loss,
                             [*operands, *(o for o in saved if isinstance(o, Node))])
    if detach:
        raise NoTail("its nodes run under different grad modes")


def _recount(graph: Graph, tail: LossTail, hidden: Node) -> None:
    """Each ``item.size(0)`` / ``item.numel()`` the tail reads (a mean's count of rows)
    becomes the hidden states' count of rows, so that it outlives the items."""
    for i, s in enumerate(tail.whole):
        if s in tail.sizes:
            with graph.inserting_before(s):
                rows = graph.call_method("size", (graph.call_method("flatten", (hidden, 0, -2)), 0))
            rows.meta.update(s.meta)
            s.replace_all_uses_with(rows)
            graph.erase_node(s)
            tail.whole[i] = rows


def rewrite_loss_tail(graph: Graph, stats: Node, config: Config, stock_fp32: bool = False
                      ) -> Optional[LossInCall]:
    """Replace the fused call ``stats`` and its loss tail by one :func:`lm_head_loss` call
    and say what it computes, or None where the region keeps the recompute path (the
    reason logged at debug level).  ``stock_fp32``: stock keeps the region's FP32
    ``[T, V]`` (NOTE [FP32 weight sums and stock's memory])."""
    if not config.gradients_in_forward:
        return None
    head, opts = head_of_node(stats), HeadOptions.from_node(stats)
    keeps = opts.plan == "auto" and keeps_logits(meta(head.hidden).device.type, stock_fp32) \
        and bound_args(stats).get("returned_like") is None
    regrouped = None  # (sums per sequence written as sums over the rows: NOTE [per-sequence sums])
    try:
        tail, regrouped = match_regrouped(graph, stats, lambda ignore: match_loss_tail(graph, stats, ignore))
        if keeps and not (config.skip_masked_rows and skip_rows_body(tail)):  # (rows left out: the loop)
            raise NoTail("the call keeps its logits (tiling.keeps_logits), the loss stays in the graph")
        plan = _plan(tail, stock_fp32)
        _check(graph, tail, [head.hidden, head.weight, head.bias], [])
        tail_key, final_key = _bodies(tail)  # (before the graph changes: it may still say no)
    except (NoTail, Decline) as why:
        if regrouped is not None:
            regrouped.undo()
        log.debug("chunked_logits: %s: no gradients in the forward: %s", stats.name, why)
        return None
    committed(regrouped)
    _recount(graph, tail, head.hidden)
    why: list[str] = []  # (a masked loss that runs every row: why, NOTE [why every row runs])
    mask_key = (skip_rows_body(tail, why) or "") if config.skip_masked_rows else ""
    loss = LossOptions(tail_key, final_key, _kinds(tail), requires_grad(head.hidden),
                       requires_grad(head.weight) or requires_grad(head.bias), mask_key)
    e = Emitter(graph, tail.loss)
    call = e.function(lm_head_loss, *head, *dataclasses.replace(opts, plan=plan).to_args(),
                      *loss.to_args()[:-1], len(tail.row_operands), *tail.row_operands, *tail.whole,
                      mask_key=loss.mask_key)
    tail.loss.replace_all_uses_with(call)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(tail.nodes, key=order.__getitem__, reverse=True):
        graph.erase_node(n)
    return LossInCall(tail.describe(), plan, GEMMS[plan], bool(mask_key), "".join(why[:1]))


def rewrite_row_loss_tail(graph: Graph, call: Node, rows: tuple, whole: tuple,
                          config: Config) -> Optional[LossInCall]:
    """Replace the ``row_local_sweeps`` call ``call`` and its loss tail by one
    :func:`row_local_loss` call (``rows``, ``whole``: the ``(dtype, shape, device)`` of
    the region's inputs, the logits' among the rows, their rows' count 0: the split is
    traced here, and the call finds it by the same spec at run time, where a trace
    cannot run inside AOTAutograd's forward); what it computes, or None where the region
    keeps its call (the reason logged at debug level)."""
    if not config.gradients_in_forward:
        return None
    args = bound_args(call)  # (row_local_sweeps' parameters)
    key, budget, n, index, how = (args[k] for k in ("key", "budget_bytes", "n_rows", "index", "how"))
    hidden, weight, bias, inputs = args["hidden"], args["weight"], args["bias"], list(args["inputs"])
    why: list[str] = []  # (a masked loss that runs every row: why, NOTE [why every row runs])
    body = user_bodies.function(key)
    n_out = len(next(iter(body.graph.find_nodes(op="output"))).args[0])
    regrouped = None  # (NOTE [per-sequence sums])
    try:
        tail, regrouped = match_regrouped(graph, call,
                                          lambda ignore: match_tail(graph, call, range(n_out), ignore))
        if not same(meta(next(iter(tail.items))).numel(), math.prod(meta(hidden).shape[:-1])):
            raise NoTail("its results are not one value per row of the logits")
        _check(graph, tail, [hidden, weight, bias], inputs)  # (the call saves its inputs too)
        joined = user_bodies.register(_joined(body, n, tail))
        split = split_of_spec(joined, (index,), tuple(range(len(tail.reductions))), index,
                              rows + tuple(spec_of(meta(o), (0,)) for o in tail.row_operands),
                              whole + tuple(spec_of(meta(o)) for o in tail.whole), True)
        if not isinstance(split, Split):
            raise NoTail(f"the loss's gradient needs whole rows: {split}")
        final = _final(tail)  # (before the graph changes: it may still say no)
        mask_key = _body_mask(joined, index, n, rows, whole, inputs, tail, why) \
            if config.skip_masked_rows else ""
        plan = "gpu" if backward_plan(meta(hidden).device, meta(hidden).dtype, config.lm_head_plan) == "gpu" \
            else "two_sweeps"  # (the others: bf16 GEMMs all the same, as the call without the loss)
        _weight_sums_fit(plan, meta(hidden), meta(weight), row_local=True)
    except (NoTail, Decline) as why:
        if regrouped is not None:
            regrouped.undo()
        log.debug("chunked_logits: %s: no gradients in the forward: %s", call.name, why)
        return None
    committed(regrouped)
    _recount(graph, tail, hidden)
    with graph.inserting_before(tail.loss):
        flat = [graph.call_method("reshape", (o, -1)) for o in tail.row_operands]
        scalars = [scalar_tensor(graph, o, hidden) if is_scalar(o) else o for o in tail.whole]
        loss = graph.call_function(row_local_loss, (joined, budget, n + len(flat), index, how, hidden, weight,
                                                    bias, final, _kinds(tail), len(scalars),
                                                    row_bytes(split), plan, *inputs[:n - 1], *flat,
                                                    *inputs[n - 1:], *scalars), {"mask_key": mask_key})
    keep_meta(loss, tail.loss)
    tail.loss.replace_all_uses_with(loss)
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in sorted(tail.nodes, key=order.__getitem__, reverse=True):
        graph.erase_node(node)
    return LossInCall(tail.describe(), plan, GEMMS[plan], bool(mask_key), "".join(why[:1]))


def _body_mask(joined: str, index: int, n: int, rows: tuple, whole: tuple, inputs: list,
               tail: LossTail, why: list[str]) -> str:
    """The joined body's skip graph (``match/body_mask.py``), "" where no row can be
    skipped (``rows``, ``whole``: the region's input specs; ``inputs``: its row inputs but
    the logits, then the tensors it reads whole)."""
    nodes = [*inputs[:index], None, *inputs[index:n - 1], *tail.row_operands]
    masks = {i for i, o in enumerate(nodes) if o is not None and o in masks_among(tail, [o])}
    specs = rows + tuple(spec_of(meta(o), (0,)) for o in tail.row_operands)
    key = skip_rows_of_body(joined, index, specs, whole + tuple(spec_of(meta(o)) for o in tail.whole),
                            len(tail.reductions), masks, why)
    if key is None:
        log.debug("chunked_logits: %s: every row runs (no mask the rules can read)", joined)
    return key or ""
