"""A row-local region (:mod:`fx_passes.match.row_local`) becomes one call of
:func:`fx_passes.kernels.row_local.engine.row_local`.

Before (top-k masked token log-prob)::

    z     = logits.float() / t
    kth   = z.topk(k).values[..., -1, None]
    logp  = z.masked_fill(z < kth, -inf).log_softmax(-1)
    picked = logp.gather(-1, tokens[:, None]).squeeze(-1)

After::

    out    = row_local("<key>", budget, 2, logits, tokens, t_as_tensor)
    picked = out[0]

The region's own nodes become the body registered under ``<key>``: the user's maths on the
same FP32 values.  See NOTE [row-local body].
"""

# NOTE [row-local body]
# The region's own nodes become the body registered under ``<key>`` (copied as they are,
# a node computed without grad detached, a loss that reduces over rows computed per row),
# so the results are the user's maths on the same FP32 values; only the loop over rows
# and, for a reduction over rows (``F.cross_entropy(..., reduction="mean")``), the order
# of its sum differ.  The call goes right after the region's last node (or before the
# first reader of a result, if one comes earlier), which must come after every input the
# region reads, and is checked like every fused op
# (:func:`fx_passes.fx.placement.check_placement`).

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from ..config import Config
from ..fx.emitter import Emitter
from ..fx.graph_ops import (
    is_scalar,
    keep_meta,
    meta,
    op_name,
    requires_grad,
    scalar_tensor,
)
from ..fx.placement import check_placement, movable_before, states
from ..kernels.ops import user_bodies
from ..kernels.ops.registry import REPLAYING_BODIES
from ..kernels.row_local.engine import row_local
from ..kernels.row_local.head import row_local_head
from ..kernels.row_local.split import Split, spec_of, split_of_spec
from ..kernels.row_local.sweeps import row_local_sweeps
from ..match.lm_head import (
    FUSION_OFF,
    NOT_MODEL_PRECISION,
    READ_ELSEWHERE,
    LMHead,
    model_precision_operands,
    producer,
)
from ..match.masks import mask_read
from ..match.row_local import Flattened, RowRegion, first_user, loss_arg
from ..reporting.outcome import LMHead as Fused
from ..reporting.outcome import Outcome
from ..reporting.report import Decline, Reason
from .loss_tail import rewrite_row_loss_tail
from .row_local_body import _node, _reduce_outside, _row_shape, _same_shape_row, build_body
from .saved import saved_for_backward
from .skip_rows import skip_unread_region_rows

__all__ = ["rewrite_row_region", "plan_row_region"]


def plan_row_region(graph: Graph, region: RowRegion) -> tuple[Node, set[Node]]:
    """Every check: (the node the call goes before, results to detach); raises Decline.
    A row input computed after that node moves before it where that is exact
    (``fx/placement.movable_before``): the one change it makes to the graph."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    inside = set(region.nodes)
    last = max(region.nodes, key=order.__getitem__)
    # right after the region's last node, or before a reader of a result, if one comes
    # first (not at the first reader always: a random draw or a print between the region
    # and its reader would then lie between the absorbed nodes and the call)
    anchor = min(first_user(region.outputs, inside, order), last.next, key=order.__getitem__)
    late = [a for a in [*map(_node, region.rows), *(w for w in region.whole if isinstance(w, Node))]
            if order[a] > order[anchor]]
    if late:  # (``mask[:, None]`` written after the loss that reads a result: moved, exact)
        moved = movable_before(graph, anchor, late, frozenset(inside))
        if isinstance(moved, str):
            raise Decline(Reason.ORDER, f"{late[0].name}, which the region reads, is computed after "
                                        f"{anchor.name}, which reads its result, and cannot move: {moved}")
        for n in moved:
            anchor.prepend(n)
    at = states(graph)[0][anchor]
    if any(kind == "autocast" for kind, _, _ in at.blocks):
        raise Decline(Reason.STATE, f"{anchor.name} runs under autocast, which the chunk bodies would "
                                    "not see")
    for t in region.terminals:
        if op_name(t) == "kl_div" and loss_arg(t, "reduction", "mean") == "mean":
            _same_shape_row(region, t)  # (declines when there is none)
        elif op_name(t) != "kl_div" and loss_arg(t, "target") in inside:
            raise Decline(Reason.ORDER, f"{t.name}'s target is computed inside the region")
    rows = [_node(r) for r in region.rows]
    saved = [r for r in rows if requires_grad(r)]
    detach = check_placement(graph, region.nodes, anchor, region.outputs, rows, last, saved,
                             replays_grad_modes=True)
    return anchor, detach


def _saving_key(body: GraphModule, region: RowRegion, config: Config) -> tuple[str | None, int, int]:
    """The key of the body that saves state for the backward (``rewrite/saved.py``), if
    there is some to save, and how many masks and normalisers it saves."""
    if not (config.save_masks or config.save_normalizers) or not any(requires_grad(_node(r))
                                                                     for r in region.rows):
        return None, 0, 0
    split = saved_for_backward(body, [_row_shape(r) for r in region.rows], config.save_masks,
                               config.save_normalizers)
    if split is None:
        return None, 0, 0
    saving = user_bodies.register(split.saving)
    REPLAYING_BODIES.add(saving, (user_bodies.register(split.replaying), split.count))
    return saving, split.masks, split.normalizers


@dataclasses.dataclass
class _Head:
    """The lm_head matmul that makes row input ``index``, run by the call."""

    index: int
    head: LMHead
    detach: set[Node]  # (the placement check's, with the matmul among the absorbed nodes)


def _plan_head(graph: Graph, region: RowRegion, anchor: Node, config: Config) -> tuple[_Head | None, str]:
    """The lm_head whose logits (a row input needing a gradient) nothing but the region
    reads, when the call may run it at ``anchor`` (the placement rule, from the matmul
    on); or None and why not ("" when no such matmul makes a row input).  A region
    that takes no gradient (scoring) runs its lm_head chunk by chunk too when
    ``row_local_sweeps`` is on, if the call may (else its matmul stays, unsaid, as it
    was)."""
    scoring = config.row_local_sweeps and not any(requires_grad(_node(r)) for r in region.rows)
    for i, r in enumerate(region.rows):
        x = _node(r)
        if not isinstance(x, Node):
            continue
        wanted = requires_grad(x)
        head = producer(x) if wanted or (scoring and len(_row_shape(r)) == 2) else None
        if head is None:
            continue
        planned, why = _place_head(graph, region, anchor, config, i, head)
        return (planned, why) if wanted else (planned, "")
    return None, ""


def _place_head(graph: Graph, region: RowRegion, anchor: Node, config: Config, i: int,
                head: LMHead) -> tuple[_Head | None, str]:
    """Row input ``i`` made by ``head``: the call may run the matmul, or why not."""
    x = _node(region.rows[i])
    if not config.fuse_lm_head:
        return None, FUSION_OFF
    if any(u not in set(region.nodes) for u in x.users):
        return None, READ_ELSEWHERE
    if not model_precision_operands(head, x):
        return None, NOT_MODEL_PRECISION
    operands = [o for o in (head.hidden, head.weight, head.bias) if o is not None]
    others = [_node(q) for j, q in enumerate(region.rows) if j != i]
    whole = [w for w in region.whole if isinstance(w, Node)]
    try:  # (region.nodes are in graph order: the last is its last node)
        detach = check_placement(graph, [*region.nodes, x, *filter(None, [head.transpose])], anchor,
                                 region.outputs, [*others, *operands, *whole], region.nodes[-1],
                                 [o for o in [*operands, *others] if requires_grad(o)],
                                 replays_grad_modes=True)
    except Decline as d:
        return None, f"{d.reason.name}: {d.detail}"
    return _Head(i, head, detach), ""


def _spec(value: Any, shape: tuple[Any, ...] | None = None) -> tuple[torch.dtype, tuple[int, ...], str]:
    """``(dtype, shape, device)`` of an input of the call, as ``row_split`` reads it."""
    return spec_of(meta(_node(value)) if isinstance(_node(value), Node) else value, shape)


def _call_specs(region: RowRegion) -> tuple[tuple, tuple]:
    """The ``(dtype, shape, device)`` of the region's row inputs and inputs read whole as
    ``row_split`` reads them when the call runs (a row input's count of rows 0)."""
    return (tuple(_spec(r, (0, *_row_shape(r)[1:])) for r in region.rows),
            tuple(_spec(w) for w in region.whole))


def _others(region: RowRegion, head: _Head) -> tuple[int, ...]:
    """The row inputs besides the lm_head's logits that need a gradient."""
    return tuple(i for i, r in enumerate(region.rows) if i != head.index and requires_grad(_node(r)))


def _whole_logits(region: RowRegion, head: _Head, key: str, config: Config, specs: tuple) -> str:
    """"" when the call may run the lm_head chunk by chunk (``row_local_sweeps``: the
    body's gradient splits into per-row values and a pointwise function), else why the
    logits stay whole."""
    if not config.row_local_sweeps:
        return "row_local_sweeps=False"
    if not requires_grad(_node(region.rows[head.index])):
        return ""  # (scoring: no backward to split; _plan_head took [N, V] rows only)
    if len(_row_shape(region.rows[head.index])) != 2:
        return "the body reads them as more than [N, V] rows"
    split = split_of_spec(key, (head.index, *_others(region, head)), None, head.index, *specs)
    return "" if isinstance(split, Split) else f"the body's gradient needs whole rows: {split}"


def _call(graph: Graph, region: RowRegion, head: _Head | None, key: str, saving: str | None,
          config: Config, sweeps: bool = False) -> Node:
    """The ``row_local`` (``row_local_head``, ``row_local_sweeps``) call, before the
    graph's insertion point."""
    skip = head.index if head is not None else None  # (the call computes that row itself)
    rows = [graph.call_method("flatten", (r.x, 0, -2)) if isinstance(r, Flattened) else r
            for j, r in enumerate(region.rows) if j != skip]
    like = getattr(region.rows[0], "x", region.rows[0])  # (a Flattened row: its tensor)
    whole = [scalar_tensor(graph, w, like) if is_scalar(w) else w for w in region.whole]
    kwargs = {"saving": saving} if saving else {}
    budget, n = config.device_budget_bytes, len(region.rows)  # (0: the device's, where the call runs)
    if head is None:
        return graph.call_function(row_local, (key, budget, n, *rows, *whole), kwargs)
    h = head.head
    how = "linear" if h.transpose is None else "matmul"
    if sweeps:
        return graph.call_function(row_local_sweeps, (key, budget, n, head.index, how, h.hidden, h.weight,
                                                      h.bias, *rows, *whole))
    flatten = isinstance(region.rows[head.index], Flattened)
    return graph.call_function(row_local_head, (key, budget, n, head.index, how, flatten,
                                                h.hidden, h.weight, h.bias, *rows, *whole), kwargs)


def _detached(o: Node, region: RowRegion) -> bool:
    """Does the result ``o`` take no gradient though the region's inputs do (a ``.detach()``
    in the region, a metric)?  The call's results all would: its replacement is detached."""
    v = meta(o)
    return isinstance(v, torch.Tensor) and v.is_floating_point() and not v.requires_grad \
        and any(requires_grad(_node(r)) for r in region.rows)


def _masked(region: RowRegion, inputs: list) -> bool:
    """Does the region's loss have a mask (for a call that runs every row to say why,
    NOTE [why every row runs]): what reads its results applies one, one of its row
    ``inputs`` is one (``match/masks.mask_read``), or its body ignores labels (a
    cross-entropy's ``ignore_index``)?"""
    return mask_read(region.outputs, frozenset(region.nodes), inputs) is not None \
        or any(op_name(n) in ("cross_entropy", "nll_loss") for n in region.nodes)


def rewrite_row_region(graph: Graph, region: RowRegion, config: Config) -> Outcome:
    """Replace the region by one ``row_local`` call; raises Decline before touching the graph."""
    anchor, detach = plan_row_region(graph, region)
    head, why = _plan_head(graph, region, anchor, config)
    body = build_body(region)
    key = user_bodies.register(body)
    specs = _call_specs(region) if head is not None else ((), ())
    whole_why = _whole_logits(region, head, key, config, specs) if head is not None else ""
    sweeps = head is not None and not whole_why
    saving, masks, normalizers = _saving_key(body, region, config) if not sweeps else (None, 0, 0)
    inside = set(region.nodes)
    if head is not None:
        detach = head.detach
    alone = head is not None and not _others(region, head)
    inputs = [_node(r) for r in region.rows]
    has_mask = config.skip_masked_rows and _masked(region, inputs)
    before = set(graph.nodes)
    with graph.inserting_before(anchor):
        call = _call(graph, region, head, key, saving, config, sweeps)
        for i, o in enumerate(region.outputs):
            value = graph.call_function(operator.getitem, (call, i))
            if o in region.terminals:
                value = _reduce_outside(graph, o, value, region)
            if o in detach or _detached(o, region):  # (a terminal loss too: computed without grad)
                value = graph.call_method("detach", (value,))
            keep_meta(value, o)
            o.replace_all_uses_with(value, delete_user_cb=lambda u: u not in inside)
    for n in reversed(region.nodes):
        graph.erase_node(n)
    if head is None:  # (logits given whole: skipping rows would save only the body's work, not said)
        return Outcome.not_fused(why, saved_masks=masks, saved_normalizers=normalizers)
    for n in filter(None, [head.head.logits, head.head.transpose]):  # (a W.T read elsewhere stays)
        if not n.users:
            graph.erase_node(n)
    if sweeps:  # (with the loss in the graph: its gradients in the forward, when only the lm_head's)
        if alone and (config.gradients_in_forward or config.skip_masked_rows):
            # (the loss tail's match, or the reads', reads the new nodes' values)
            Emitter(graph, anchor).fill([n for n in graph.nodes if n not in before])
        loss = rewrite_row_loss_tail(graph, call, *specs, config) if alone else None
        if loss is not None:
            return Outcome(Fused.FUSED, losses=(loss,))
        if not alone:  # (a row input besides the logits takes a gradient: every row)
            names = ", ".join(inputs[i].name for i in _others(region, head))
            why_all = f"{names}, a row input besides the logits, takes a gradient: only the logits skip rows"
            return Outcome(Fused.FUSED, rows_why=(why_all,) if has_mask else ())
        # (its per-row results kept: the rows a mask leaves unread skipped)
        why: list[str] = []
        masked = skip_unread_region_rows(graph, call, *specs, config, why, has_mask)
        return Outcome(Fused.FUSED, masked_per_token=int(masked), rows_why=tuple(why))
    rows_why = ("its logits are kept whole: only a call that makes them chunk by chunk skips rows",) \
        if has_mask else ()
    return Outcome(Fused.IN_CALL, whole_why, saved_masks=masks, saved_normalizers=normalizers,
                   rows_why=rows_why)
