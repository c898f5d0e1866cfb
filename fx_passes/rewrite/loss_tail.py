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
row part ``tail``, the scalar part ``final``); the call runs where the loss was
(``fx/placement.check_placement``).  See NOTE [loss tail graphs].
"""

# NOTE [loss tail graphs]
# The tail (:mod:`fx_passes.match.loss_tail`) becomes two FX graphs registered in
# ``GRAPH_BODIES``: the row part ``tail(lse, logprob, entropy, *rows, *whole)`` returning
# the tensors the loss sums (views are identities there: every tensor is the flat rows of
# a chunk), and the scalar part ``final(*reductions, *whole)`` giving the loss.  The call
# runs where the loss was (``fx/placement.check_placement``: no in-place change between the
# region's call and the loss, the same autocast blocks, one grad mode).

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from typing import Optional

import torch
from torch._dynamo.utils import counters
from torch.fx import Graph, GraphModule, Node

from ..config import Config
from ..fx.emitter import Emitter
from ..fx.graph_ops import (
    bound_args,
    is_scalar,
    keep_meta,
    meta,
    op_name,
    requires_grad,
    same,
    scalar_tensor,
)
from ..fx.op_rules import Kind, tail_rule
from ..fx.placement import check_placement, movable_before
from ..kernels.log_softmax.lm_head import lm_head_row_stats
from ..kernels.log_softmax.lm_head_masked import lm_head_row_stats_masked
from ..kernels.log_softmax.loss import PLANS, lm_head_loss, trace_tail
from ..kernels.ops import user_bodies
from ..kernels.ops.args import HeadOptions, LossOptions, head_of_node
from ..kernels.row_local.loss import row_bytes, row_local_loss
from ..kernels.row_local.masked import row_local_sweeps_masked
from ..kernels.row_local.split import Split, spec_of, split_of_spec
from ..kernels.tiling import backward_plan, holds_weight_sums, weight_sums_why
from ..match.body_mask import skip_rows_of_body, skip_rows_of_region_reads
from ..match.loss_tail import (
    VIEWS,
    LossTail,
    NoTail,
    match_loss_tail,
    match_reads,
    match_region_reads,
    match_tail,
)
from ..match.masks import masks_among
from ..match.row_mask import skip_rows_body, skip_rows_of_reads
from ..reporting.outcome import LossInCall
from ..reporting.report import Decline, log, say_once

__all__ = ["rewrite_loss_tail", "rewrite_row_loss_tail", "skip_unread_rows", "skip_unread_region_rows",
           "fused_calls", "GEMMS"]

# model-precision-input GEMMs of one step, in units of [T, H] x [H, V], per plan (unit incoming gradient)
GEMMS = {"gpu": 3, "two_sweeps": 4}


def fused_calls(graph: Graph) -> set[Node]:
    """The fused lm_head calls of ``graph`` (each may have a loss tail)."""
    return {n for n in graph.nodes if n.op == "call_function" and n.target is lm_head_row_stats}


def _plan(tail: LossTail) -> str:
    """The plan the op runs (``tiling.backward_plan`` of the region's device and dtype)."""
    hidden = meta(head_of_node(tail.stats).hidden)
    plan = backward_plan(hidden.device, hidden.dtype, HeadOptions.from_node(tail.stats).plan)
    if plan not in PLANS:
        raise NoTail(f"the {plan!r} plan computes no gradient in the forward")
    _weight_sums_fit(plan, hidden, meta(head_of_node(tail.stats).weight))
    return plan


def _weight_sums_fit(plan: str, hidden, weight) -> None:
    """NoTail where the ``"gpu"`` loss would hold FP32 ``[V, H]`` sums above what stock
    keeps (``tiling.holds_weight_sums``), said in the log and counted."""
    rows = math.prod(hidden.shape[:-1])
    rows = rows if isinstance(rows, int) else None
    (vocab, width), kind = weight.shape[-2:], hidden.device.type
    if plan == "gpu" and not holds_weight_sums(rows, int(vocab), int(width), kind):
        why = weight_sums_why(rows, int(vocab), int(width))
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


def _bodies(tail: LossTail) -> tuple[str, str]:
    """(tail key, final key): the row part and the scalar part as registered FX graphs."""
    rows, env = Graph(), {}
    items = [rows.placeholder(name) for name in ("lse", "logprob", "entropy")]
    for node, i in tail.items.items():
        env[node] = items[i]
    for o in [*tail.row_operands, *tail.whole]:
        env[o] = rows.placeholder(o.name)
    _copy_rows(rows, tail, env)
    rows_key = user_bodies.register(GraphModule(torch.nn.Module(), rows))
    device = meta(head_of_node(tail.stats).hidden).device
    examples = [torch.zeros(3, device=device) for _ in range(3)]
    examples += [torch.zeros(3, dtype=meta(o).dtype, device=device) for o in tail.row_operands]
    examples += [_whole_example(o, device) for o in tail.whole]
    examples += [torch.zeros((), device=device) for _ in tail.reductions]
    tail_key = trace_tail(rows_key, len(tail.row_operands) + len(tail.whole), examples)
    return tail_key, _final(tail)


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


def _copy_rows(g: Graph, tail: LossTail, env: dict) -> None:
    """The tail's row part into ``g`` (``env``: its inputs), returning what the loss
    sums: every tensor is a chunk's flat rows, so the views are identities."""
    for n in tail.rows:
        env[n] = env[n.args[0]] if op_name(n) in VIEWS else g.node_copy(n, env.__getitem__)
    g.output(tuple(env[r.all_input_nodes[0]] for r in tail.reductions))


def _final(tail: LossTail) -> str:
    """The key of the scalar part ``final(*reductions, *whole) -> (loss, *weights)``,
    ``weights[k] = d loss / d reductions[k]`` (:func:`_factors`)."""
    final, env = Graph(), {}
    for r in tail.reductions:
        env[r] = final.placeholder(r.name)
    for o in tail.whole:
        env[o] = final.placeholder(o.name)
    for n in tail.scalars:
        env[n] = final.node_copy(n, env.__getitem__)
    final.output((env[tail.loss], *_factors(final, tail, env)))
    return user_bodies.register(GraphModule(torch.nn.Module(), final))


def _factors(g: Graph, tail: LossTail, env: dict) -> list[Node]:
    """Nodes of ``g`` computing, in FP64, ``d loss / d reductions[k]`` from the values the
    scalar part reads whole (``env``: their placeholders).  The part is affine in the
    reductions (``match/loss_tail.py``), so each factor is the product of the factors met
    on the way to the loss: a constant term (``+ ref.mean()``, infinite or not) plays no
    part, as in autograd."""
    k = len(tail.reductions)
    whole = {o: g.call_method("double", (g.call_function(torch.as_tensor, (env[o],)),)) for o in tail.whole}

    def value(a):
        return whole[a] if isinstance(a, Node) else a

    def times(c, f, op=operator.mul):
        if c is None:
            return None
        return g.call_function(op, (c, f)) if isinstance(c, Node) or isinstance(f, Node) else op(c, f)

    def plus(c, d):
        return c if d is None else d if c is None else times(c, d, operator.add)
    coef: dict[Node, list] = {r: [1.0 if j == i else None for j in range(k)]
                              for i, r in enumerate(tail.reductions)}
    for n in tail.scalars:
        name, args = op_name(n), list(n.args)
        rule, why = tail_rule(n, name)  # (the matcher took it: fx/op_rules.py, the same table)
        if rule is None:
            raise NoTail(f"{n.name}: {why}")
        if str(n.target).startswith("__r") and name != "rsub":  # (``x.__rtruediv__(c)`` is ``c / x``;
            args.reverse()  # ``rsub(x, c)`` is ``c - x`` already, as ATen's ``rsub``)
        of = [coef.get(a, [None] * k) if isinstance(a, Node) else [None] * k for a in args[:2]]
        if rule.kind is Kind.SUM_OF_TERMS:
            alpha = value(n.kwargs.get("alpha", 1))
            a, b = (of[1], of[0]) if name == "rsub" else (of[0], of[1])
            sign = -1.0 if name != "add" else 1.0
            coef[n] = [plus(x, times(times(y, alpha), sign)) for x, y in zip(a, b)]
        elif rule.kind is Kind.NEGATE:
            coef[n] = [times(x, -1.0) for x in of[0]]
        elif rule.kind is Kind.FACTOR:
            mine = 0 if args[0] in coef else 1
            if name == "div" and mine == 1:
                raise NoTail(f"{n.name} divides by a sum over the rows")
            op = operator.mul if name == "mul" else operator.truediv
            coef[n] = [times(x, value(args[1 - mine]), op) for x in of[mine]]
        elif rule.kind is Kind.SAME:  # pos, a conversion: the factor of its input
            coef[n] = of[0]
        else:
            raise NoTail(f"{n.name} ({name}) is {rule.kind.value}, not a step of an affine map")
    # A constant factor is made like the first reduction (a 0-d tensor on the call's
    # device): a factory without a device would make a host tensor, and moving it to a
    # GPU is a copy that syncs the host every step.
    like, f64 = env[tail.reductions[0]], {"dtype": torch.float64}
    return [c if isinstance(c, Node) else g.call_function(torch.full_like, (like, c or 0.0), f64)
            for c in coef[tail.loss]]


def _kinds(tail: LossTail) -> str:
    return ",".join(f"{op_name(r)}:{str(meta(r).dtype).removeprefix('torch.')}" for r in tail.reductions)


def _whole_example(node: Node, device: torch.device) -> torch.Tensor:
    """A 0-d tensor like the one ``lm_head_loss`` makes of ``node`` at run time."""
    v = meta(node)
    if isinstance(v, torch.Tensor):
        return torch.zeros((), dtype=v.dtype, device=device)
    return torch.zeros((), dtype=torch.float32 if isinstance(v, (float, torch.SymFloat)) else torch.int64,
                       device=device)


def rewrite_loss_tail(graph: Graph, stats: Node, config: Config) -> Optional[LossInCall]:
    """Replace the fused call ``stats`` and its loss tail by one :func:`lm_head_loss` call
    and say what it computes, or None where the region keeps the recompute path (the
    reason logged at debug level)."""
    if not config.gradients_in_forward:
        return None
    head, opts = head_of_node(stats), HeadOptions.from_node(stats)
    try:
        tail = match_loss_tail(graph, stats)
        plan = _plan(tail)
        _check(graph, tail, [head.hidden, head.weight, head.bias], [])
        tail_key, final_key = _bodies(tail)  # (before the graph changes: it may still say no)
    except (NoTail, Decline) as why:
        log.debug("chunked_logits: %s: no gradients in the forward: %s", stats.name, why)
        return None
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


def skip_unread_rows(graph: Graph, stats: Node, config: Config, why: Optional[list[str]] = None) -> bool:
    """Make the fused call ``stats``, which keeps its per-token results,
    ``lm_head_row_stats_masked`` with the skip graph of their readers
    (``match/row_mask.skip_rows_of_reads``: rows a mask leaves unread are left out of its
    loop); False where it has none (the reason logged at debug level; where the reads have
    a mask, appended to ``why`` too: NOTE [why every row runs])."""
    if not config.skip_masked_rows:
        return False

    def find(said: list[str]) -> Optional[tuple[str, list[Node]]]:
        if len(stats.args) > 10:  # (``returned_like``: the graph returns the logits, every row)
            raise NoTail("the graph returns its logits")
        return skip_rows_of_reads(match_reads(graph, stats), said)
    return _masked_call(graph, stats, find, lm_head_row_stats_masked, why)


def skip_unread_region_rows(graph: Graph, call: Node, rows: tuple, whole: tuple, config: Config,
                            why: list[str], masked: bool = False) -> bool:
    """Make the ``row_local_sweeps`` call ``call``, whose per-row results the graph keeps,
    ``row_local_sweeps_masked`` with the skip graph of the body and the results' readers
    (``match/body_mask.skip_rows_of_region_reads``: NOTE [row-local rows a mask leaves
    unread]; ``rows``, ``whole``: the body's input specs, the logits' among the rows);
    False where it has none (as :func:`skip_unread_rows`; ``masked``: the region is
    known to have a mask, so the reason is said whatever stops the match)."""
    if not config.skip_masked_rows:
        return False
    args = bound_args(call)  # (row_local_sweeps' parameters)
    key, n, index, inputs = args["key"], args["n_rows"], args["index"], list(args["inputs"])
    device = getattr(meta(args["hidden"]), "device", None)
    if device is not None and device.type != "cpu":  # (NOTE [row-local rows a mask leaves unread])
        reason = (f"on {device.type} this call runs every row: its backward would read the skipped rows' "
                  "cotangents and the count from the device, two more syncs a step")
        log.debug("chunked_logits: %s: every row runs: %s", call.name, reason)
        if masked:
            why.append(reason)
        return False

    def find(said: list[str]) -> Optional[tuple[str, list[Node]]]:
        n_out = len(next(iter(user_bodies.function(key).graph.find_nodes(op="output"))).args[0])
        tail = match_region_reads(graph, call, n_out)
        nodes = [*inputs[:index], None, *inputs[index:n - 1]]
        masks = {i for i, o in enumerate(nodes) if o is not None and o in masks_among(tail, [o])}
        return skip_rows_of_region_reads(key, index, rows, whole, tail, masks, said)
    return _masked_call(graph, call, find, row_local_sweeps_masked, why, masked)


def _masked_call(graph: Graph, call: Node, find, target, why: Optional[list[str]],
                 masked: bool = False) -> bool:
    """Retarget ``call`` to its masked op ``target`` with the skip graph ``find(said)``
    gives (its key and the nodes it reads; None, or :class:`NoTail`, where it has none:
    logged, and said in ``why`` where ``said`` shows the reads have a mask, or
    ``masked``)."""
    said: list[str] = []  # (non-empty once the reads are known to have a mask)
    try:
        found = find(said)
        if found is None:
            raise NoTail(said[0] if said else "no mask leaves a row's results unread")
        said.append("")  # (a mask: the reasons below are said too)
        key, read = found
        if any(not isinstance(meta(o), torch.Tensor) for o in read):
            raise NoTail("the mask reads a number")
        early = _earlier(graph, call, read)
    except NoTail as reason:
        log.debug("chunked_logits: %s: every row runs: %s", call.name, reason)
        if (said or masked) and why is not None:
            why.append(str(reason))
        return False
    for n in early:
        call.prepend(n)
    call.target = target
    call.kwargs = {**call.kwargs, "mask_key": key, "mask_operands": list(read)}
    return True


def _earlier(graph: Graph, stats: Node, read: list[Node]) -> list[Node]:
    """The nodes to move before ``stats`` (in order) so that ``read`` are computed before
    it (``fx/placement.movable_before``: a mask's ``.float()``, ``> 0``); or :class:`NoTail`."""
    moved = movable_before(graph, stats, read)
    if isinstance(moved, str):
        raise NoTail(f"the mask is computed after the region: {moved}")
    return moved


def _joined(body: GraphModule, n_rows: int, tail: LossTail) -> GraphModule:
    """``(*rows, *tail rows, *whole, *tail whole) -> (what the loss sums)``: a row-local
    region's body, then its loss tail's row part on its results (each flattened)."""
    g, env = Graph(), {}
    places = [p for p in body.graph.nodes if p.op == "placeholder"]
    rows = [g.placeholder(f"row{i}") for i in range(n_rows)]
    env.update(zip(tail.row_operands, (g.placeholder(f"tail_row{i}") for i in range(len(tail.row_operands)))))
    whole = [g.placeholder(f"whole{i}") for i in range(len(places) - n_rows)]
    env.update(zip(tail.whole, (g.placeholder(f"tail_whole{i}") for i in range(len(tail.whole)))))
    inner = dict(zip(places, [*rows, *whole]))
    for n in body.graph.nodes:
        if n.op == "output":
            results = [inner[r] for r in n.args[0]]
        elif n.op != "placeholder":
            inner[n] = g.node_copy(n, inner.__getitem__)
    for item, i in tail.items.items():
        env[item] = g.call_method("reshape", (results[i], -1))
    _copy_rows(g, tail, env)
    return GraphModule(torch.nn.Module(), g)


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
    try:
        tail = match_tail(graph, call, range(n_out))
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
        _weight_sums_fit(plan, meta(hidden), meta(weight))
    except (NoTail, Decline) as why:
        log.debug("chunked_logits: %s: no gradients in the forward: %s", call.name, why)
        return None
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
