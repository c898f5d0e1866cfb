"""What each op means to the derivations: the one table the faster paths consult before
they re-derive the user's maths instead of running the user's ops.

:data:`TAIL` serves the loss tail (``match/loss_tail.py``, ``rewrite/loss_tail.py``),
:data:`BLOCK` the vocabulary-block split (``kernels/row_local/split.py``).  An op not in the
table, or a keyword argument (or value) the table does not list for it, declines the
derivation, the op and the argument named in the reason: the region keeps the recompute
path (or its whole rows), never a silently different answer.  See NOTE [derivations].
"""

# NOTE [derivations]
# Two derivations read ops instead of running them:
#
# * the **loss tail** (``match/loss_tail.py``, ``rewrite/loss_tail.py``): the scalar part
#   from the sums over the rows to the loss is read as an affine map (its factors
#   ``d loss / d sum_k`` computed from the ops, :data:`TAIL`), and the sums themselves
#   (:data:`TAIL`'s ``REDUCE_ROWS``) are accumulated over the row chunks.  The row part
#   (one value per row) runs the user's own ops on each chunk with autograd's gradient, so
#   any pointwise op is taken there as it is (:func:`tail_row_rule`), but no rounding to
#   16 bits (``match/loss_tail.py``, NOTE [16-bit roundings in a tail]);
# * the **vocabulary-block split** (``kernels/row_local/split.py``): a row-local body's gradient
#   computed per block of columns from per-row statistics (:data:`BLOCK`, ATen ops after
#   Inductor's decompositions).  A reduction over the row is a per-row statistic, computed
#   over whole rows by the split's stats graph; an op that reads the row's *length* (the
#   vocabulary size ``V``) as a value (a mean's ``1 / V``, a variance's ``1 / (V - c)``,
#   ``label_smoothing / V``) would read the block's width in a block: the split declines
#   (:func:`reads_row_length`), and the call keeps whole rows (same results, the logits'
#   memory).  How the torch-level ops and keyword arguments reach the split:
#   ``mean`` / ``var`` / ``std`` (``keepdim``, ``correction``), ``cross_entropy``'s
#   ``label_smoothing`` read ``V``: declined; ``softmax`` / ``log_softmax`` /
#   ``logsumexp`` and ``cross_entropy``'s ``ignore_index`` / ``weight`` /
#   ``reduction='none'`` become per-row statistics, per-column inputs and pointwise ops.

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
from typing import Any, Optional

import torch
from torch.fx import Node

__all__ = ["Kind", "OpRule", "TAIL", "BLOCK", "ANY", "tail_rule", "tail_row_rule", "block_rule",
           "reads_row_length", "FLOATS", "RESHAPES", "TAIL_ROWS", "ZERO_ROWS"]


class Kind(enum.Enum):
    SUM_OF_TERMS = "a sum of its operands (``alpha`` scaling the second)"
    FACTOR = "its tensor operand times (``mul``) or over (``div``) a value read whole: a linear factor"
    NEGATE = "minus its operand"
    SAME = "its operand's value (a conversion: a linear factor of 1)"
    REDUCE_ROWS = "a sum / mean over all rows: chunk sums accumulated in FP64, rounded once to its dtype"
    PER_ROW = "one value a row from values of that row, run as written (autograd's gradient per chunk)"
    ROW_VIEW = "a view that keeps one value a row in order: an identity on a chunk's flat rows"
    PER_COLUMN = "a pointwise op: a block's columns from the same columns of its operands"
    BLOCK_SIZED = "a view / expand / creation op whose size argument is the block's own width"
    ONE_COLUMN = "one value a row put at one column (a scatter): a where on the block's column indices"
    SELECT = "one of two operands per element by a condition (``where``, ``masked_fill``): no arithmetic"
    EXP = "``exp``: an increasing map whose derivative is its value"
    LOG = "``log``: an increasing map on positive values whose derivative is ``1 / x``"
    POWER = "``x ** k`` for a whole number 1 <= k <= 8 (``pow``, ``square``): 0 where x is 0"
    CLAMP = "its operand clamped to number bounds: a derivative of 0 or 1"
    EXTREMUM = "the smaller / larger of two tensors per element: a derivative of 0, 1/2 or 1 each"
    COMPARE = "a comparison of two operands per element: 0 or 1 (False / True), no gradient"


ANY = object()  # (a keyword argument any value of which keeps the rule)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class OpRule:
    kind: Kind
    positional: int  # positional arguments the rule reads (more: declined)
    kwargs: tuple[tuple[str, Any], ...] = ()  # (name, allowed values or ANY); others declined
    size_arg: Optional[int] = None  # BLOCK_SIZED: the position of its size argument


def _kw(**allowed: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(allowed.items())


_CONVERT = OpRule(Kind.SAME, 1)
# The loss tail's scalar part and reductions, by torch-level name (fx/graph_ops.op_name).
TAIL: dict[str, OpRule] = {
    "add": OpRule(Kind.SUM_OF_TERMS, 2, _kw(alpha=ANY)),
    "sub": OpRule(Kind.SUM_OF_TERMS, 2, _kw(alpha=ANY)),
    "rsub": OpRule(Kind.SUM_OF_TERMS, 2, _kw(alpha=ANY)),
    "neg": OpRule(Kind.NEGATE, 1),
    "positive": OpRule(Kind.SAME, 1),
    "mul": OpRule(Kind.FACTOR, 2),
    # (``rounding_mode='floor'`` / ``'trunc'``: a step function, a zero gradient, not a factor)
    "div": OpRule(Kind.FACTOR, 2, _kw(rounding_mode=(None,))),
    "sum": OpRule(Kind.REDUCE_ROWS, 1, _kw(dtype=(None, *FLOATS))),  # (a ``dim``: not over all rows)
    "mean": OpRule(Kind.REDUCE_ROWS, 1, _kw(dtype=(None, *FLOATS))),
    "to": OpRule(Kind.SAME, 2, _kw(dtype=FLOATS, non_blocking=ANY, copy=ANY)),
    "float": _CONVERT, "double": _CONVERT, "half": _CONVERT, "bfloat16": _CONVERT,
    "type_as": OpRule(Kind.SAME, 2),
}
# The row part: views that keep the rows' order, conversions and copies (any pointwise op too).
TAIL_ROWS: dict[str, Kind] = {
    **dict.fromkeys(("view", "reshape", "flatten", "unsqueeze", "squeeze", "contiguous"), Kind.ROW_VIEW),
    **dict.fromkeys(("float", "double", "half", "bfloat16", "to", "type", "type_as", "detach", "clone"),
                    Kind.PER_ROW),
}

# What the rows a loss leaves out are made of (``match/row_mask.py``, NOTE [rows a loss leaves
# out]): how a zero value / a zero cotangent crosses each op of the loss tail's row part.
# An op missing here zeroes nothing and passes no zero on: its rows are computed.
ZERO_ROWS: dict[str, Kind] = {
    **dict.fromkeys(("convert", "float", "double", "half", "bfloat16", "to", "type", "type_as", "detach",
                     "clone", "contiguous", "positive"), Kind.SAME),
    **dict.fromkeys(("view", "reshape", "flatten", "unsqueeze", "squeeze"), Kind.ROW_VIEW),
    "neg": Kind.NEGATE,
    **dict.fromkeys(("add", "sub", "rsub"), Kind.SUM_OF_TERMS),
    **dict.fromkeys(("mul", "div"), Kind.FACTOR),
    **dict.fromkeys(("where", "masked_fill"), Kind.SELECT),
    "exp": Kind.EXP,
    "log": Kind.LOG,
    **dict.fromkeys(("pow", "square"), Kind.POWER),
    **dict.fromkeys(("clamp", "clip", "clamp_min", "clamp_max"), Kind.CLAMP),
    **dict.fromkeys(("min", "max", "minimum", "maximum"), Kind.EXTREMUM),
    **dict.fromkeys(("gt", "lt", "ge", "le", "eq", "ne"), Kind.COMPARE),  # (``greater`` .. : op_name's)
}

aten = torch.ops.aten
# The vocabulary-block split's ops besides pointwise ones (ATen, after decompositions).
BLOCK: dict[Any, OpRule] = {
    aten.expand.default: OpRule(Kind.BLOCK_SIZED, 2, size_arg=1),
    aten.alias.default: OpRule(Kind.PER_COLUMN, 1),
    aten.clone.default: OpRule(Kind.PER_COLUMN, 1, _kw(memory_format=ANY)),
    aten.view.default: OpRule(Kind.BLOCK_SIZED, 2, size_arg=1),
    aten._unsafe_view.default: OpRule(Kind.BLOCK_SIZED, 2, size_arg=1),
    aten.reshape.default: OpRule(Kind.BLOCK_SIZED, 2, size_arg=1),
    aten.unsqueeze.default: OpRule(Kind.BLOCK_SIZED, 2),
    aten.squeeze.dim: OpRule(Kind.BLOCK_SIZED, 2),
    aten.full.default: OpRule(Kind.BLOCK_SIZED, 2, _kw(dtype=ANY, layout=ANY, device=ANY, pin_memory=ANY),
                              size_arg=0),
    aten.full_like.default: OpRule(Kind.BLOCK_SIZED, 2, _kw(dtype=ANY, layout=ANY, device=ANY,
                                                            pin_memory=ANY, memory_format=ANY)),
    aten.zeros_like.default: OpRule(Kind.BLOCK_SIZED, 1, _kw(dtype=ANY, layout=ANY, device=ANY,
                                                             pin_memory=ANY, memory_format=ANY)),
    aten.ones_like.default: OpRule(Kind.BLOCK_SIZED, 1, _kw(dtype=ANY, layout=ANY, device=ANY,
                                                            pin_memory=ANY, memory_format=ANY)),
    aten.scalar_tensor.default: OpRule(Kind.BLOCK_SIZED, 1, _kw(dtype=ANY, layout=ANY, device=ANY,
                                                                pin_memory=ANY)),
    aten.scatter.value: OpRule(Kind.ONE_COLUMN, 4),
    aten.scatter.src: OpRule(Kind.ONE_COLUMN, 4),
    aten.scatter_add.default: OpRule(Kind.ONE_COLUMN, 4),
}

# Views that keep the vocabulary last (a class weight ``[V]`` viewed as ``[1, V]``): taken
# in a block only on a wide input, whose sizes (symbolic) are the block's own.
RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
            aten.squeeze.dim}


def _check_args(name: str, rule: OpRule, args: tuple, kwargs: dict) -> Optional[str]:
    if len(args) > rule.positional:
        return f"{name} with {len(args)} positional arguments (the table reads {rule.positional})"
    allowed = dict(rule.kwargs)
    for k, v in kwargs.items():
        if k not in allowed:
            return f"{name}'s keyword argument {k}={v!r} is not in the op table"
        if allowed[k] is not ANY and not any(v is a or v == a for a in allowed[k]):
            return f"{name}({k}={v!r}) changes what the op means (the table takes {k} in {allowed[k]})"
    return None


def tail_rule(node: Node, name: str) -> tuple[Optional[OpRule], str]:
    """(the rule of the loss tail's scalar or reduction node ``node``, whose op_name is
    ``name``, "") or (None, why the table declines it)."""
    rule = TAIL.get(name)
    if rule is None:
        return None, f"{name} is not in the loss tail's op table"
    why = _check_args(name, rule, node.args, dict(node.kwargs))
    return (None, why) if why else (rule, "")


def tail_row_rule(name: str) -> Optional[Kind]:
    """The kind of a row-part op of the loss tail, None when the table does not take it."""
    return TAIL_ROWS.get(name) or (Kind.PER_ROW if pointwise_op(name) else None)


@functools.lru_cache(None)
def pointwise_op(name: str) -> bool:
    """Does ATen tag ``name`` pointwise (and not random)?"""
    op = getattr(torch.ops.aten, name, None) if name and not name.startswith("_") else None
    if not isinstance(op, torch._ops.OpOverloadPacket):
        return False
    tags = [getattr(op, o).tags for o in op.overloads()]
    return any(torch.Tag.pointwise in t for t in tags) and not any(
        torch.Tag.nondeterministic_seeded in t for t in tags)


def block_rule(target: Any) -> Optional[OpRule]:
    """The rule of an ATen op computing a wide (``[.., V]``) value in a vocabulary block."""
    if target in BLOCK:
        return BLOCK[target]
    if torch.Tag.pointwise in getattr(target, "tags", ()):
        return OpRule(Kind.PER_COLUMN, len(getattr(getattr(target, "_schema", None), "arguments", ())))
    return None


def _symbols(value: Any) -> set:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return set(value.node.expr.free_symbols)
    return set()


def reads_row_length(node: Node, vocab: Any) -> Optional[str]:
    """Why ``node`` of a traced vector-Jacobian product cannot run on a vocabulary block:
    it reads the row's length ``vocab`` (a SymInt) as a value (a mean's ``1 / V``, a
    label smoothing's ``eps / V``), where a block would give its own width; None when it
    reads ``vocab`` only as the size argument of a view / expand / creation op (the
    block's own size there) or not at all."""
    mine = _symbols(vocab)
    if not mine or node.op != "call_function":
        return None
    rule = BLOCK.get(node.target)
    for i, a in enumerate([*node.args, *node.kwargs.values()]):
        if rule is not None and i == rule.size_arg:
            continue
        leaves = a if isinstance(a, (list, tuple)) else (a,)
        if any(isinstance(x, Node) and _symbols(x.meta.get("val")) & mine for x in leaves):
            name = getattr(node.target, "__name__", str(node.target))
            if node.target in (operator.mul, operator.truediv, operator.sub, operator.add):
                name = f"the size arithmetic {name}"
            return f"{name} reads the row's length (the vocabulary size) as a value"
    return None
