"""The body a row-local region becomes: :func:`build_body` replays the region's own nodes
(a node computed without grad detached, a loss that reduces over rows computed per row:
``_per_row_loss``), and ``_reduce_outside`` reduces such a loss's per-row values over the
rows after the call, as the loss would.  See NOTE [row-local body] in
``rewrite/row_local.py``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Graph, GraphModule, Node

from ..fx.graph_ops import meta, op_name, requires_grad, same_shape, tensor_input
from ..match.row_local import LOSS_PARAMS, Flattened, RowRegion, loss_arg
from ..reporting.report import Decline, Reason

__all__ = ["build_body"]


def _per_row_loss(g: Graph, n: Node, env: dict) -> Node:
    """The per-row values of a loss that reduces over rows (its ``reduction="none"``,
    summed over everything but dim 0 for ``kl_div``)."""
    name = op_name(n)
    inp, tgt = env[tensor_input(n)], env[loss_arg(n, "target")]
    if name == "kl_div":
        per = g.call_function(F.kl_div, (inp, tgt), {"reduction": "none",
                                                     "log_target": loss_arg(n, "log_target", False)})
        ndim = meta(tensor_input(n)).dim()
        return g.call_method("sum", (per, tuple(range(1, ndim)))) if ndim > 1 else per
    kwargs: dict[str, Any] = {"reduction": "none"}
    for k in ("weight", "ignore_index", "label_smoothing"):
        if k in _given(n):
            v = loss_arg(n, k)
            kwargs[k] = env[v] if isinstance(v, Node) else v
    smoothing = kwargs.pop("label_smoothing", 0.0)
    if name == "nll_loss" or meta(loss_arg(n, "target")).is_floating_point() or isinstance(smoothing, Node):
        fn = F.cross_entropy if name == "cross_entropy" else F.nll_loss
        if smoothing:
            kwargs["label_smoothing"] = smoothing
        return g.call_function(fn, (inp, tgt), kwargs)
    return _cross_entropy_rows(g, inp, tgt, kwargs, smoothing)


def _cross_entropy_rows(g: Graph, inp: Node, tgt: Node, kwargs: dict[str, Any], smoothing: float) -> Node:
    """``F.cross_entropy(inp, tgt, reduction="none", ...)`` of class indices, as torch
    computes it (``cross_entropy_loss_label_smoothing``): a ``log_softmax``, ``nll_loss``
    and label smoothing's term, so the softmax's statistics can be saved for the backward."""
    logp = g.call_function(torch.log_softmax, (inp, 1))
    nll = g.call_function(F.nll_loss, (logp, tgt), kwargs)
    if not smoothing:
        return nll
    weight = kwargs.get("weight")
    terms = g.call_function(operator.mul, (logp, weight)) if weight is not None else logp
    smooth = g.call_function(operator.neg, (g.call_method("sum", (terms, 1)),))
    ignored = g.call_function(operator.eq, (tgt, kwargs.get("ignore_index", -100)))
    smooth = g.call_method("masked_fill", (smooth, ignored, 0.0))
    classes = g.call_method("size", (inp, 1))
    return g.call_function(operator.add, (g.call_function(operator.mul, (nll, 1.0 - smoothing)),
                                          g.call_function(operator.mul, (smooth, g.call_function(
                                              operator.truediv, (smoothing, classes))))))


def _given(n: Node) -> set[str]:
    params = LOSS_PARAMS[op_name(n)]
    return set(n.kwargs) | set(params[:max(0, len(n.args) - 1)])


def _same_shape_row(region: RowRegion, n: Node) -> Node:
    """A row input of the shape of loss ``n``'s input (whose numel a mean divides by)."""
    shape = tuple(meta(tensor_input(n)).shape)
    for r in region.rows:
        if same_shape(_row_shape(r), shape):
            return _node(r)  # (a flattened view has the numel of the logits)
    raise Decline(Reason.NOT_ROW_LOCAL, f"{n.name} (kl_div, mean) divides by the numel of a tensor the "
                                        "region does not read whole")


def _node(value: Any) -> Any:
    """The graph node a row input reads (the logits for a flattened view of them)."""
    return value.x if isinstance(value, Flattened) else value


def build_body(region: RowRegion) -> GraphModule:
    """``fn(*rows, *whole) -> tuple(outputs)``: the region's nodes, replayed."""
    g = Graph()
    env: dict[Any, Node] = {}
    for i, r in enumerate(region.rows):
        env[r] = g.placeholder(f"row{i}")
    for i, w in enumerate(region.whole):
        env[w] = g.placeholder(f"whole{i}")
    differentiable = any(requires_grad(_node(r)) for r in region.rows)
    for n in region.nodes:
        if n in region.flattened:
            continue  # its views read the flattened logits instead, upcast in the body:
        if tensor_input(n) in region.flattened:
            env[n] = g.node_copy(tensor_input(n), lambda a: env[Flattened(a)])
        elif n in region.terminals:
            env[n] = _per_row_loss(g, n, env)
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
        v = meta(n)
        if differentiable and isinstance(v, torch.Tensor) and v.is_floating_point() and not v.requires_grad:
            env[n] = g.call_method("detach", (env[n],))  # the graph computed it without grad
    g.output(tuple(env[o] for o in region.outputs))
    return GraphModule(torch.nn.Module(), g)


def _reduce_outside(graph: Graph, n: Node, partial: Node, region: RowRegion) -> Node:
    """The terminal loss ``n``'s reduction over rows, from its per-row ``partial``."""
    name, how = op_name(n), loss_arg(n, "reduction", "mean")
    total = graph.call_method("sum", (partial,))
    if how == "sum":
        return total
    if name == "kl_div":
        if how == "batchmean":
            rows = graph.call_method("size", (partial, 0))
            return graph.call_function(operator.truediv, (total, rows))
        numel = graph.call_method("numel", (_same_shape_row(region, n),))
        return graph.call_function(operator.truediv, (total, numel))
    target, weight = loss_arg(n, "target"), loss_arg(n, "weight")
    if meta(target).is_floating_point():  # class probabilities: a mean over the rows
        return graph.call_function(operator.truediv, (total, graph.call_method("size", (partial, 0))))
    valid = graph.call_function(operator.ne, (target, loss_arg(n, "ignore_index", -100)))
    if weight is None:
        count = graph.call_method("sum", (valid,))
    else:
        safe = graph.call_function(torch.where, (valid, target, 0))
        picked = graph.call_function(operator.getitem, (weight, safe))
        count = graph.call_method("sum", (graph.call_function(torch.where, (valid, picked, 0.0)),))
    return graph.call_function(operator.truediv, (total, count))


def _row_shape(r: Any) -> tuple[Any, ...]:
    """The shape of row input ``r`` as the body reads it (a flattened view: ``[N, V]``)."""
    v = meta(_node(r))
    return (v.shape[:-1].numel(), v.shape[-1]) if isinstance(r, Flattened) else tuple(v.shape)
