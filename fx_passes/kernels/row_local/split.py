"""A row-local body's vector-Jacobian product split into per-row statistics and a
pointwise function of the logits, so the lm_head's ``grad_weight`` can be computed by
vocabulary blocks over all rows (:mod:`fx_passes.kernels.row_local.sweeps`).

:func:`split_of` returns ``stats(*args) -> (*grads of the wanted row inputs, *per-row
values)``, run on chunks of whole rows, and ``block(*picked args, *per-row values) -> grad
of x[:, v0:v1]``, run on all rows of one block (``Split.inputs``); or, for a body with a
sort, a scan, a gather or a scatter on the way to the gradient, the reason it does not
split.  See NOTE [row split].
"""

# NOTE [row split]
#
# A body's gradient with respect to its logits ``x`` (``[R, V]``) is, for a distillation
# loss, a label-smoothed cross-entropy or a KL term, a pointwise function of ``x``, the
# other ``[R, V]`` row inputs (a teacher's logits), per-column constants (class weights),
# per-row inputs (the incoming gradients) and a few reductions over each row (the softmax
# maxima and sums, the sums of the incoming gradient's products).  Given those per-row
# values, the gradient of any block of columns ``[:, v0:v1]`` can be computed from that
# block alone.  :func:`split_of` finds this form by tracing the product to ATen ops
# (Inductor's decompositions: ``log_softmax`` and its backward become ``amax``, ``exp``,
# ``sum``, ...) with symbolic sizes, and sorts every value by its shape:
#
# * *wide* (its last dimension is the vocabulary): must come from a pointwise op (or an
#   ``expand`` / a creation op), so that it can be computed per block of columns;
# * *narrow* and computed from a wide value (a reduction over the row, and what follows
#   it): a per-row value, computed by the ``stats`` graph over whole rows and read by the
#   ``block`` graph from its ``[T, ..]`` buffer;
# * anything else (inputs, values of per-row inputs alone): recomputed in the block.
#
# ``stats(*args) -> (*grads of the wanted row inputs, *per-row values)`` runs on chunks of
# whole rows; ``block(*picked args, *per-row values) -> grad of x[:, v0:v1]`` on all rows
# of one block (``Split.inputs`` says which argument each block input is and whether its
# columns are sliced).  A body with a sort, a scan, a gather or a scatter on the way to
# the gradient (top-k / top-p masks, a cross-entropy's picked logit) does not split; its
# call keeps the logits whole (``row_local_head``), with the reason in the log.

# NOTE [a soft-target cross-entropy traced with symbolic sizes]
#
# ``F.cross_entropy`` with class probabilities as its target is an ATen composite whose
# C++ body reads the input's sizes as numbers in torch 2.11 and 2.12: traced with
# symbolic sizes, the vocabulary becomes the example's constant (an ``expand`` to
# ``[13, 256]`` in the product), the logits' gradient no longer spans the symbolic
# vocabulary, and a distillation loss on a teacher's probabilities kept its logits whole
# there (2.13 reads symbolic sizes).  The trace runs the body through
# :class:`_SymbolicSizes`, which computes such a call (per-row results, no class weights)
# by ATen's own formula, ``-(log_softmax(x, 1) * target).sum(1)`` with a smoothed target
# ``target * (1 - e) + e / V``: the same ops in the same order, on symbolic sizes.  A
# smoothed target reads ``V`` as a value, so it still keeps its rows whole, as on 2.13.
# tests/test_op_rules.py (the soft-target bodies split as their rule says) fails on 2.11
# without it; tests/test_row_split.py makes 2.13's ATen read sizes as numbers too.

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch.fx import Graph, GraphModule, Interpreter, Node

from ...fx.op_rules import RESHAPES as _RESHAPES
from ...fx.op_rules import Kind, block_rule, reads_row_length
from ..ops import user_bodies

__all__ = ["Split", "split_of", "split_of_spec", "spec_of", "COLUMNS"]

COLUMNS = -1  # (a block input that is the block's column indices, ``[1, v1 - v0]``)

_ROWS = 13  # rows of the traced example (a size no other dimension is likely to share)
_WIDEST = 1024  # numbers a row a per-row value may hold (a top-k's values: k)


@dataclasses.dataclass(frozen=True)
class Split:
    stats: GraphModule  # (*inputs, *grads) -> (*grads of wanted, *per-row values)
    block: GraphModule  # (*inputs[i] for i, _ in inputs, *per-row values) -> grad of the logits block
    inputs: tuple[tuple[int, bool], ...]  # (argument of stats or COLUMNS, its columns sliced) per block input
    values: int  # per-row values the stats graph returns after the gradients (and the results)
    value_specs: tuple[tuple[torch.dtype, tuple[int, ...]], ...] = ()  # each one's dtype and size a row
    outputs: int = 0  # the body's results the stats graph returns after the gradients (with_outputs)


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.expr == b.node.expr


class _Sorter:
    """Builds the block graph from the traced product (one per split)."""

    def __init__(self, traced: GraphModule, x: Node):
        self.v, self.r = x.meta["val"].shape[-1], x.meta["val"].shape[0]
        self.graph, self.env = Graph(), {}
        self.inputs: list[tuple[int, bool]] = []
        self.values: list[Node] = []
        self.places_made: list[Node] = []
        self.columns: Optional[Node] = None
        self.places = [n for n in traced.graph.nodes if n.op == "placeholder"]
        if not (isinstance(self.v, torch.SymInt) and isinstance(self.r, torch.SymInt)):
            # (a vocabulary the trace specialised would hide which values span it)
            raise _NoSplit("the trace made the vocabulary or the rows a constant")
        self.from_wide: dict[Node, bool] = {}
        for n in traced.graph.nodes:
            self.from_wide[n] = self.wide(n) or any(self.from_wide.get(a, False) for a in n.all_input_nodes)

    def wide(self, n: Node) -> bool:
        v = n.meta.get("val")
        return isinstance(v, torch.Tensor) and v.dim() > 0 and _same(v.shape[-1], self.v)

    def rowed(self, n: Node) -> bool:
        v = n.meta.get("val")
        return isinstance(v, torch.Tensor) and v.dim() > 0 and _same(v.shape[0], self.r)

    def copy(self, n: Node) -> Node:
        if n in self.env:
            return self.env[n]
        v = n.meta.get("val")
        if n.op == "placeholder":
            shape = v.shape if isinstance(v, torch.Tensor) else ()
            if any(_same(s, self.v) for s in shape[:-1]):
                raise _NoSplit(f"input {n.name} has the vocabulary in a dimension other than the last")
            self.inputs.append((self.places.index(n), self.wide(n)))
            out = self.graph.placeholder(n.name)
            self.places_made.append(out)
        elif isinstance(v, torch.Tensor) and self.from_wide[n] and not self.wide(n):
            per_row = v.shape[1:]
            if not self.rowed(n) or not all(isinstance(d, int) for d in per_row) or per_row.numel() > _WIDEST:
                raise _NoSplit(f"{n.name} ({n.target}) is neither per row nor per column")
            self.values.append(n)  # a per-row value: the stats graph computes it
            out = self.graph.placeholder(f"row_{n.name}")
        else:
            if self.wide(n):
                shape = v.shape
                if not (shape[-1:] == (self.v,) and (v.dim() == 1 or (v.dim() == 2 and (
                        _same(shape[0], self.r) or shape[0] == 1)))):
                    raise _NoSplit(f"{n.name} ({n.target}) has shape {tuple(shape)}")
                rule = block_rule(n.target)  # (fx/op_rules.py: the one table of what ops mean)
                if rule is not None and rule.kind is Kind.ONE_COLUMN:
                    out = self.env[n] = self.scatter(n)
                    return out
                reshaped = n.target in _RESHAPES and self.wide(n.args[0])
                if rule is None or (n.target in _RESHAPES and not reshaped):
                    raise _NoSplit(f"{getattr(n.target, '__name__', n.target)} is not pointwise")
            why = reads_row_length(n, self.v)  # (a block would read its own width for V)
            if why:
                raise _NoSplit(why)
            out = self.graph.node_copy(n, self.copy)
        self.env[n] = out
        return out


    def scatter(self, n: Node) -> Node:
        """``scatter(base, -1, index, src)`` with one index a row (``[R, 1]``), in a block:
        ``where(columns == index, src, base)`` (``base + src`` for ``scatter_add``)."""
        base, dim, index, src = n.args[:4]
        v = n.meta["val"]
        idx = index.meta.get("val") if isinstance(index, Node) else None
        one_a_row = isinstance(idx, torch.Tensor) and idx.dim() == 2 and _same(idx.shape[0], self.r) \
            and idx.shape[1] == 1
        if dim not in (-1, v.dim() - 1) or not one_a_row or (isinstance(src, Node) and self.wide(src)):
            raise _NoSplit(f"{n.target} of more than one column a row is not pointwise")
        if self.columns is None:  # (the block's column indices, [1, columns], int64)
            self.columns = self.graph.placeholder("columns")
            self.places_made.append(self.columns)
            self.inputs.append((COLUMNS, False))
        b, i = self.copy(base), self.copy(index)
        s = self.copy(src) if isinstance(src, Node) else src
        hit = self.graph.call_function(torch.ops.aten.eq.Tensor, (self.columns, i))
        if n.target is torch.ops.aten.scatter_add.default:
            s = self.graph.call_function(torch.ops.aten.add.Tensor, (b, s))
        return self.graph.call_function(torch.where, (hit, s, b))


class _NoSplit(Exception):
    pass


def soft_target_cross_entropy(x: torch.Tensor, target: Any, weight: Any = None, size_average: Any = None,
                              ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                              label_smoothing: float = 0.0) -> Optional[torch.Tensor]:
    """``F.cross_entropy(x, target, ...)`` of ``[R, V]`` logits and class probabilities,
    per row and without class weights, as ATen computes it, on symbolic sizes; None for
    any other call (NOTE [a soft-target cross-entropy traced with symbolic sizes])."""
    if not (isinstance(target, torch.Tensor) and target.is_floating_point() and x.dim() == 2
            and target.dim() == 2 and weight is None and size_average is None and reduce is None
            and reduction == "none"):
        return None
    if label_smoothing > 0.0:
        target = target * (1 - label_smoothing) + label_smoothing / x.shape[1]
    return -(torch.log_softmax(x, 1) * target).sum(1)


class _SymbolicSizes(Interpreter):
    """A body run op by op, its soft-target cross-entropies by their formula."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is F.cross_entropy:
            out = soft_target_cross_entropy(*args, **kwargs)
            if out is not None:
                return out
        return super().call_function(target, args, kwargs)


def _examples(rows: list, whole: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Zeros of each ``(dtype, shape, device)``, the rows' first size ``_ROWS``, on the
    inputs' devices (the traced graphs' constants, a scatter's zeros, are made there)."""
    made = [torch.zeros((_ROWS, *shape[1:]), dtype=dtype, device=device) for dtype, shape, device in rows]
    return made, [torch.zeros(shape, dtype=dtype, device=device) for dtype, shape, device in whole]


def split_of_spec(key: str, wanted: tuple[int, ...], outputs: Optional[tuple[int, ...]], index: int,
                  rows: tuple, whole: tuple, with_outputs: bool = False) -> Union[Split, str]:
    """:func:`split_of` from the inputs' ``(dtype, shape, device)`` (a row input's first
    size unused): what the rewrite knows.  ``outputs`` None: the floating-point results
    (the ones the call's backward receives, so that it finds this split cached);
    ``with_outputs``: the stats graph returns them too, after the gradients (a loss's
    forward, :mod:`fx_passes.kernels.row_local.loss`)."""
    if any(_ROWS in shape[1:] for _, shape, _ in rows) or any(_ROWS in shape for _, shape, _ in whole):
        return f"an input has a dimension of {_ROWS}, the traced rows"
    if outputs is None:
        ex_rows, ex_whole = _examples(list(rows), list(whole))
        results = user_bodies.function(key)(*ex_rows, *ex_whole)
        outputs = tuple(i for i, o in enumerate(results) if o.is_floating_point())
    return _traced_split(key, wanted, outputs, index, rows, whole, with_outputs)


@functools.lru_cache(None)
def _traced_split(key: str, wanted: tuple[int, ...], outputs: tuple[int, ...], index: int, rows: tuple,
                  whole: tuple, with_outputs: bool) -> Union[Split, str]:
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import _disable_current_modes

    body = user_bodies.function(key)
    fn = _SymbolicSizes(body).run
    ex_rows, ex_whole = _examples(list(rows), list(whole))
    results = fn(*ex_rows, *ex_whole)
    grads = [torch.zeros_like(results[i]) for i in outputs]
    n = len(ex_rows) + len(ex_whole)
    try:  # (outside the caller's compile: its fake mode and shape guards are not this trace's, nor
        # the dispatch mode AOTAutograd's compiled forward runs under)
        with _disable_current_modes(), unset_fake_temporarily(), torch._guards.tracing(None), \
                torch.enable_grad():
            vjp = user_bodies.vjp_function(fn, n, wanted, outputs, with_outputs)
            traced = make_fx(vjp, decomposition_table=select_decomp_table(),
                             tracing_mode="symbolic")(*ex_rows, *ex_whole, *grads)
        out = next(iter(traced.graph.find_nodes(op="output")))
        places = [p for p in traced.graph.nodes if p.op == "placeholder"]
        grad_x = out.args[0][wanted.index(index)]
        sorter = _Sorter(traced, places[index])
        if not sorter.wide(grad_x):  # (a vocabulary the trace made a constant on the way: a class weight's)
            raise _NoSplit("the logits' gradient does not keep the vocabulary's symbolic size")
        sorter.graph.output(sorter.copy(grad_x))
    except _NoSplit as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a body make_fx cannot trace keeps its logits whole
        return f"its vector-Jacobian product cannot be traced ({type(e).__name__}: {e})"
    values = sorter.values
    # the block's inputs first, then its per-row values, in the stats graph's order
    _put_first(sorter.graph, [*sorter.places_made, *(sorter.env[v] for v in values)])
    stats_out = next(iter(traced.graph.find_nodes(op="output")))
    stats_out.args = ((*stats_out.args[0], *values),)
    stats = GraphModule(traced, traced.graph)
    block = GraphModule(traced, sorter.graph)
    for gm in (stats, block):
        gm.graph.eliminate_dead_code()
        gm.recompile()
    specs = tuple((v.meta["val"].dtype, tuple(v.meta["val"].shape[1:])) for v in values)
    return Split(stats, block, tuple(sorter.inputs), len(values), specs, len(outputs) if with_outputs else 0)


def _put_first(graph: Graph, places: list[Node]) -> None:
    """Move the placeholders ``places`` to the front of ``graph``, in that order."""
    for p in reversed(places):
        first = next(iter(graph.nodes))
        if first is not p:
            first.prepend(p)


def spec_of(v: Any, shape: Optional[tuple[Any, ...]] = None) -> tuple[torch.dtype, tuple[int, ...], str]:
    """``(dtype, shape, device)`` of an example value ``v`` (a fake tensor or a number)
    as :func:`split_of_spec` takes it, ``shape`` in place of its own; a number is passed
    to the call as a 0-d host tensor.  Symbolic sizes count as their hints."""
    if not isinstance(v, torch.Tensor):
        return (torch.float32 if isinstance(v, (float, torch.SymFloat)) else torch.int64), (), "cpu"
    sizes = shape if shape is not None else v.shape
    return v.dtype, tuple(int(d) if not isinstance(d, torch.SymInt) else (d.node.hint or 2) for d in sizes), \
        str(v.device)


def _spec(ts: list[torch.Tensor], skip: int) -> tuple:
    return tuple(spec_of(t, (0,) * min(skip, t.dim()) + tuple(t.shape[skip:])) for t in ts)


def split_of(key: str, wanted: list[int], outputs: list[int], index: int, rows: list[torch.Tensor],
             whole: list[torch.Tensor], with_outputs: bool = False) -> Union[Split, str]:
    """The split of body ``key``'s vector-Jacobian product for the logits ``rows[index]``
    (``wanted``: the row inputs that take a gradient, ``index`` among them; ``outputs``:
    the results whose gradients come in), or why there is none.  Cached per body and
    input dtypes and shapes (the rows' count does not matter)."""
    return split_of_spec(key, tuple(wanted), tuple(outputs), index, _spec(rows, 1), _spec(whole, 0),
                         with_outputs)
