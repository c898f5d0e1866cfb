"""Row-local regions: any loss on the logits whose ops act on each row on its own.

What the hand-derived path (:mod:`fx_passes.match.upcast_regions`) declines for an op it does not
know goes through here: the region is found by *row-locality* (rows are the indices of dim
0 of the logits), not by a list of patterns, and runs as the user's own ops over chunks of
rows (:mod:`fx_passes.kernels.row_local.engine`).  A region whose tensors reach an op that is not
row-local other than as per-row results is declined naming that op (``NOT_ROW_LOCAL``).
See NOTE [row-locality].
"""

# NOTE [row-locality]
# Rows are the indices of dim 0 of the logits.  A region starts at FP32 upcasts of
# model-precision logits ``[rows, .., V]`` and takes in every op that reads one of its
# tensors and acts on each row on its own:
#
# * pointwise ops (ATen's own ``pointwise`` tag, random ones excepted), conversions,
#   ``detach`` / ``clone``, ``zeros_like`` / ``full_like`` ... (which read only the
#   shape), with operands that are region tensors, per-row tensors (dim 0 of size rows,
#   as many dims as the result) or broadcast ones (no dim 0 of size rows: scalars,
#   ``[V]`` vectors, 0-d tensors);
# * reductions, softmaxes, scans, sorts and ``topk`` along dims other than 0;
#   ``gather`` / ``scatter`` / ``take_along_dim`` along them, with per-row indices;
# * indexing that keeps dim 0 whole (``x[:, :k]``, ``x[..., -1, None]``), ``unsqueeze``
#   / ``squeeze`` of other dims, the items of a sort's / top-k's tuple;
# * ``cross_entropy`` / ``nll_loss`` (class weights, label smoothing, ``ignore_index``) and
#   ``kl_div``: per row inside the region; a ``mean`` / ``sum`` / ``batchmean`` over rows
#   is done outside (a *terminal*).
#
# It also takes in, backwards, the FP32 ``[rows, .., V]`` tensors its ops read that are
# computed from another upcast by row-local ops (a teacher's log-probs).  It ends where
# its tensors are read by an op that is not row-local: such a tensor must be a per-row
# result (no last dim V), or the region is declined naming that op (``NOT_ROW_LOCAL``).

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch.fx import Graph, Node

from ..fx.graph_ops import (
    canon,
    get_arg,
    is_low_precision,
    is_scalar,
    meta,
    mutates,
    op_name,
    requires_grad,
    same,
    tensor_input,
)
from ..fx.op_rules import pointwise_op
from ..reporting.report import Decline, Reason
from .short_floats import computed_short, rounds_to_16_bits
from .upcast import upcast_input

__all__ = ["RowRegion", "pointwise_op", "find_row_region", "TERMINAL_LOSSES", "check_row_local", "loss_arg",
           "first_user", "LOSS_PARAMS"]

_CONVERSIONS = {"float", "double", "half", "bfloat16", "long", "int", "bool", "type_as"}
_IDENTITIES = {"detach", "clone", "contiguous", "alias"}
_LIKE = {"zeros_like", "ones_like", "full_like", "empty_like"}  # (not new_*: their size is given)
ALL, REQUIRED = "all", "required"
# op -> (position of its dim argument after the tensor, what no dim means)
_ALONG: dict[str, tuple[int, Any]] = {
    **{r: (1, ALL) for r in ("sum", "mean", "nansum", "amax", "amin", "prod", "any", "all", "argmax",
                             "argmin", "max", "min", "std", "var", "count_nonzero")},
    **{s: (1, REQUIRED) for s in ("logsumexp", "softmax", "log_softmax", "cumsum", "cumprod",
                                  "logcumsumexp", "cummax", "cummin", "gather", "scatter",
                                  "scatter_add", "scatter_reduce")},
    "sort": (1, -1), "argsort": (1, -1), "topk": (2, -1), "kthvalue": (2, -1), "take_along_dim": (2, ALL),
}
_INDEXED = {"gather": ("index",), "scatter": ("index", "src"), "scatter_add": ("index", "src"),
            "scatter_reduce": ("index", "src"), "take_along_dim": ("indices",)}
TERMINAL_LOSSES = ("cross_entropy", "nll_loss", "kl_div")
LOSS_PARAMS = {
    "cross_entropy": ("target", "weight", "size_average", "ignore_index", "reduce", "reduction",
                      "label_smoothing"),
    "nll_loss": ("target", "weight", "size_average", "ignore_index", "reduce", "reduction"),
    "kl_div": ("target", "size_average", "reduce", "reduction", "log_target"),
}


def loss_arg(node: Node, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a cross_entropy / nll_loss / kl_div call."""
    if name in node.kwargs:
        return node.kwargs[name]
    pos = 1 + LOSS_PARAMS[op_name(node)].index(name)
    return node.args[pos] if pos < len(node.args) else default


@dataclasses.dataclass(frozen=True)
class Flattened:
    """The model-precision logits ``x`` with their leading dims flattened into rows
    (``x.flatten(0, -2)``, a view), which the rewrite makes: a region whose upcast the
    graph only flattens (``logits.float().view(-1, V)``, as Hugging Face losses do)
    reads them so, the view moved before the upcast (both exact, so they commute)."""

    x: Node


@dataclasses.dataclass
class RowRegion:
    """What the rewrite needs (graph order throughout)."""

    seeds: list[Node]  # the FP32 upcasts of model-precision logits (or the views flattening one)
    nodes: list[Node]  # every node of the region, seeds included
    rows: list[Any]  # graph values read per row (sliced along dim 0), the logits first: Node | Flattened
    whole: list[Any]  # graph values read whole by every chunk: tensors, symbolic scalars
    outputs: list[Node]  # region nodes read outside it (per-row results)
    terminals: list[Node]  # losses reduced over rows outside the region (among outputs)
    flattened: tuple[Node, ...] = ()  # the upcasts the graph only flattens: their views are seeds

    def describe(self) -> str:
        ops = sorted({op_name(n) for n in self.nodes if op_name(n) not in ("", "getitem")})
        return (f"row-local region over {len(self.seeds)} logits tensor(s) ({', '.join(ops)}), "
                f"{len(self.outputs)} per-row result(s), in chunks of rows")


def _tensors(node: Node) -> list[torch.Tensor]:
    v = meta(node)
    items = v if isinstance(v, (tuple, list)) else [v]
    return [t for t in items if isinstance(t, torch.Tensor)]


def _dims(node: Node, name: str, ndim: int) -> Optional[list[int]]:
    """The dims ``node`` acts along (normalised), [] for none, None for all of them."""
    pos, missing = _ALONG[name]
    if name in ("max", "min") and len(node.args) > 1 and isinstance(node.args[1], Node):
        return []  # torch.max(a, b): pointwise
    dim = node.kwargs.get("dim", node.args[pos] if pos < len(node.args) else missing)
    if dim is ALL or dim is None:
        return None
    if dim is REQUIRED:
        raise Decline(Reason.NOT_ROW_LOCAL, f"{node.name} ({name}) has no dim argument the pass can read")
    dims = list(dim) if isinstance(dim, (tuple, list)) else [dim]
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return None
    return [d % max(ndim, 1) for d in dims]


def _keeps_rows(node: Node) -> bool:
    """An index of a tensor that keeps dim 0 whole: ``x[:, ..]`` or ``x[..., i]``."""
    index = node.args[1] if len(node.args) > 1 else None
    index = index if isinstance(index, tuple) else (index,)
    if not all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in index):
        return False
    if index and index[0] == slice(None):
        return True
    real = [i for i in index if i is not None and i is not Ellipsis]
    return bool(index) and index[0] is Ellipsis and len(real) < meta(tensor_input(node)).dim()


def _not_row_local(node: Node, why: str) -> Decline:
    return Decline(Reason.NOT_ROW_LOCAL, f"{node.name} ({op_name(node) or node.op}) {why}")


def check_row_local(node: Node) -> Optional[str]:
    """Why ``node`` does not act on each row of its region input on its own, or None.
    (Its operands' shapes are checked when the region is complete: :func:`_operands`.)"""
    name = op_name(node)
    if node.op not in ("call_function", "call_method") or mutates(node):
        return "has a side effect or changes a tensor in place"
    src = tensor_input(node)
    ndim = meta(src).dim() if isinstance(src, Node) and isinstance(meta(src), torch.Tensor) else 0
    if name == "getitem":
        if isinstance(meta(src), (tuple, list)):
            return None if isinstance(node.args[1], int) else "indexes a tuple by a value"
        return None if _keeps_rows(node) else "indexes dim 0 (the rows)"
    if canon(node) == "convert" or name in _CONVERSIONS | _IDENTITIES | _LIKE:  # (_LIKE: reads the shape)
        out = meta(node)
        same_device = isinstance(out, torch.Tensor) and out.device == meta(src).device
        return None if same_device else "moves the tensor to another device"
    if name in ("unsqueeze", "squeeze"):
        dim = get_arg(node, "dim", node.args[1] if len(node.args) > 1 else None)
        width = meta(node).dim() if name == "unsqueeze" else ndim
        return None if isinstance(dim, int) and dim % max(width, 1) != 0 else "may change dim 0"
    if name in TERMINAL_LOSSES:
        return None if _loss_ok(node, name) else "has options the pass does not read (size_average / reduce)"
    if name in _ALONG:
        dims = _dims(node, name, ndim)
        if dims is None or 0 in dims:
            return "reduces or reorders along dim 0 (across rows)"
        return None
    if pointwise_op(name):
        return None
    return "is not known to act on each row on its own"


def _loss_ok(node: Node, name: str) -> bool:
    if loss_arg(node, "size_average") is not None or loss_arg(node, "reduce") is not None:
        return False
    if name == "kl_div":
        return True
    inp = meta(tensor_input(node))
    return isinstance(inp, torch.Tensor) and inp.dim() == 2


def _is_terminal(node: Node) -> bool:
    if op_name(node) not in TERMINAL_LOSSES:
        return False
    default = "mean"
    return loss_arg(node, "reduction", default) != "none"


def _wide(node: Any, rows: Any, width: Any) -> bool:
    """An FP32-or-wider floating tensor ``[rows, .., V]``."""
    v = meta(node) if isinstance(node, Node) else None
    return (isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 2 and not is_low_precision(v)
            and same(v.shape[0], rows) and same(v.shape[-1], width))


def _seed_of(node: Node) -> Optional[Node]:
    """``node`` when it is an FP32 upcast of model-precision logits ``[rows, .., V]``."""
    src = upcast_input(node)
    v = meta(src) if isinstance(src, Node) else None
    fp32 = getattr(meta(node), "dtype", None) == torch.float32
    return node if isinstance(v, torch.Tensor) and is_low_precision(v) and v.dim() >= 2 and fp32 else None


def _flattening_views(seed: Node) -> list[Node]:
    """The users of the upcast ``seed`` of ``[.., .., V]`` logits when all of them view it
    as ``[rows, V]`` (``view(-1, V)``, ``reshape``, ``flatten(0, -2)``), else []."""
    v = meta(seed)
    if v.dim() < 3:
        return []
    n = v.shape[:-1].numel()
    views = [u for u in seed.users if canon(u) in ("reshape", "flatten") and tensor_input(u) is seed
             and isinstance(meta(u), torch.Tensor) and meta(u).dim() == 2
             and same(meta(u).shape[0], n) and same(meta(u).shape[1], v.shape[-1])]
    return views if views and len(views) == len(seed.users) else []


def find_row_region(graph: Graph, seed: Node) -> RowRegion:
    """The row-local region around the upcast ``seed``; raises Decline (and touches
    nothing) when there is none the pass can run in chunks."""
    if _seed_of(seed) is None:
        raise Decline(Reason.NOT_ROW_LOCAL, f"{seed.name} is not an FP32 upcast of bf16/fp16 logits")
    starts = _flattening_views(seed) or [seed]
    flattened = [seed] if starts[0] is not seed else []
    v = meta(starts[0])
    rows, width = v.shape[0], v.shape[-1]
    region: dict[Node, None] = dict.fromkeys([seed, *starts])
    work = list(starts)

    def take(n: Node) -> None:
        region[n] = None
        work.append(n)

    while work:
        n = work.pop()
        for a in n.all_input_nodes:  # backwards: FP32 [rows, .., V] tensors computed row-locally
            if a in region or not _wide(a, rows, width):
                continue
            up = _flattened_upcast(a)
            if up is not None:  # (a teacher's logits.float().view(-1, V): the upcast and all its views)
                region[up] = None
                flattened.append(up)
                for view in _flattening_views(up):
                    take(view)
            elif _seed_of(a) is not None or (check_row_local(a) is None and _rounds(a) is None):
                take(a)
        if _is_terminal(n):  # (reduced over the rows: what reads it is outside the region)
            continue
        for u in n.users:
            if u in region:
                continue
            why = check_row_local(u)
            low = _rounds(u) if why is None else None  # (left in the graph, after a per-row result)
            if why is None and low is None:
                take(u)
            elif _wide(n, rows, width) and u.op == "output":
                raise Decline(Reason.ESCAPES, f"{n.name} (FP32 [rows x .. x V]) is a graph output")
            elif _wide(n, rows, width) and low is not None:
                raise Decline(Reason.ESCAPES, f"{u.name} ({op_name(u)}) {low}, so it stays in the graph, "
                                              f"and it reads {n.name} (FP32 [rows x .. x V])")
            elif _wide(n, rows, width):
                raise _not_row_local(u, f"{why} and reads {n.name} (FP32 [rows x .. x V])")
    nodes = [n for n in graph.nodes if n in region]
    views = [v for f in flattened for v in _flattening_views(f)]
    replaced = {*flattened, *views}  # (the body upcasts the flattened x)
    seeds = [n for n in nodes
             if n not in replaced and _seed_of(n) is not None and upcast_input(n) not in region]
    sources = [upcast_input(s) for s in seeds]  # (a teacher's upcast among them)
    if flattened:  # (the seed's own first: the logits first)
        seeds, sources = [*views, *seeds], [*(Flattened(upcast_input(f)) for f in flattened), *sources]
    rows_in, whole = _operands([n for n in nodes if n not in replaced], region, sources, rows)
    outputs = [n for n in nodes if any(u not in region for u in n.users)]
    terminals = [n for n in nodes if _is_terminal(n)]
    for o in outputs:
        if o in terminals:
            continue
        if not _tensors(o) or any(t.dim() == 0 or not same(t.shape[0], rows) or (
                t.dim() >= 2 and same(t.shape[-1], width)) for t in _tensors(o)):
            shape = [tuple(t.shape) for t in _tensors(o)]
            raise Decline(Reason.ESCAPES, f"{o.name} {shape} is read outside the region and is not a "
                                          "per-row result")
        if isinstance(meta(o), (tuple, list)):
            raise Decline(Reason.ESCAPES, f"{o.name}'s tuple is read outside the region whole")
    for n in nodes:
        if n in terminals or n in flattened:
            continue
        for t in _tensors(n):
            if t.dim() == 0 or not same(t.shape[0], rows):
                raise _not_row_local(n, f"makes a tensor of shape {tuple(t.shape)}, whose dim 0 is not "
                                        "the rows")
    return RowRegion(seeds, nodes, rows_in, whole, outputs, terminals, tuple(flattened))


def _rounds(node: Node) -> Optional[str]:
    """Why the body leaves ``node`` to the graph, or None: it rounds to 16 bits, or reads a
    16-bit tensor the graph computes (NOTE [16-bit roundings in a row-local body])."""
    low, read = rounds_to_16_bits(node), [a for a in node.all_input_nodes if computed_short(a)]
    if low is None and not read:
        return None
    what = f"rounds to {low}" if low is not None else \
        f"reads {read[0].name}, {meta(read[0]).dtype} the graph computes"
    return f"{what}, where stock's fused kernel keeps FP32 (NOTE [16-bit roundings in a row-local body])"


def _flattened_upcast(view: Node) -> Optional[Node]:
    """The upcast of ``[.., .., V]`` logits that ``view`` flattens to ``[rows, V]``, when
    the graph only flattens it, else None."""
    up = tensor_input(view) if canon(view) in ("reshape", "flatten") else None
    if not isinstance(up, Node) or _seed_of(up) is None:
        return None
    return up if view in _flattening_views(up) else None


def _operands(nodes: list[Node], region: dict, sources: list[Any], rows: Any) -> tuple[list[Any], list[Any]]:
    """Every graph value ``nodes`` read: per row (sliced with the rows) or whole;
    ``sources``, the logits the seeds upcast, first."""
    row_inputs: dict[Any, None] = dict.fromkeys(sources)
    whole: dict[Any, None] = {}
    for n in nodes:
        name = op_name(n)
        out = _tensors(tensor_input(n) if name in TERMINAL_LOSSES else n)  # a loss: its input's dims
        out_ndim = out[0].dim() if out else 0
        per_row = set(_INDEXED.get(name, ()))
        if name in ("cross_entropy", "nll_loss"):
            per_row.add("target")
        for a in n.all_input_nodes:
            if a in region or a in row_inputs:
                continue
            v = meta(a)
            if is_scalar(a):  # (the body gets it as a 0-d tensor: an operand of pointwise maths only)
                if not isinstance(v, (float, torch.SymFloat)) or not pointwise_op(name):
                    raise _not_row_local(n, f"reads {a.name}, a number the graph computes, as an argument "
                                            "that takes no tensor")
                whole[a] = None
                continue
            if not isinstance(v, torch.Tensor):
                raise _not_row_local(n, f"reads {a.name}, which is not a tensor or a scalar")
            named = [k for k in per_row if (get_arg(n, k) if name in _INDEXED else loss_arg(n, k)) is a]
            if v.dim() >= 1 and same(v.shape[0], rows) and (named or v.dim() == out_ndim):
                row_inputs[a] = None
            elif named:
                raise _not_row_local(n, f"reads {a.name} {tuple(v.shape)} as per-row indices, not one row "
                                        "of them per row")
            elif v.dim() < out_ndim or (v.dim() == out_ndim and same(v.shape[0], 1)):
                if requires_grad(a):
                    raise _not_row_local(n, f"reads {a.name} whole in every chunk, and it requires grad")
                whole[a] = None
            else:
                raise _not_row_local(n, f"reads {a.name} {tuple(v.shape)}, which is neither per row nor "
                                        "broadcast over the rows")
    return list(row_inputs), list(whole)


def first_user(nodes: list[Node], region: set[Node], order: dict[Node, int]) -> Node:
    """The first node outside ``region`` that reads one of ``nodes``."""
    return min((u for n in nodes for u in n.users if u not in region), key=order.__getitem__)


