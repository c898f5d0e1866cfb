"""Read Dynamo (torch-level) FX nodes as canonical ops.

A Dynamo graph spells one op many ways: ``x.float()``, ``x.to(torch.float32)``,
``torch.log_softmax(x, dim=-1)``, ``F.log_softmax(x, -1)``, ``x.log_softmax(-1)``,
``operator.truediv`` ... One naming scheme: :func:`op_name` is ATen's name of any call;
:func:`canon` is that name for the matcher's known spellings, one op's spellings merged
(``float`` / ``to`` -> "convert"), and :func:`get_arg` reads an argument by position or
keyword, so the matcher is written once per op, not once per spelling.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import compat

__all__ = ["canon", "op_name", "same", "same_shape", "get_arg", "bound_args", "meta", "is_low_precision",
           "is_metadata_query", "attribute_view", "is_pure", "is_collective", "mutates", "is_mode_switch",
           "call_name", "GRAD_SWITCH", "MODE_OPENERS", "MODE_CLOSERS", "is_elementwise", "requires_grad",
           "is_number", "is_scalar", "scaled_by_number", "scalar_tensor", "keep_meta", "graph_snapshot",
           "restore_graph"]

LOW_PRECISION = (torch.bfloat16, torch.float16)

# canonical name -> (torch-level callables, Tensor method names)
_SPELLINGS: dict[str, tuple[tuple[Any, ...], tuple[str, ...]]] = {
    "convert": ((), ("float", "to", "type")),
    "getitem": ((operator.getitem,), ()),
    "reshape": ((torch.reshape,), ("view", "reshape")),
    "flatten": ((torch.flatten,), ("flatten",)),
    "contiguous": ((), ("contiguous",)),
    "div": ((operator.truediv, torch.div, torch.true_divide), ("div", "true_divide", "__truediv__")),
    "mul": ((operator.mul, torch.mul), ("mul", "__mul__", "__rmul__")),
    "sub": ((operator.sub, torch.sub), ("sub", "__sub__")),
    "neg": ((operator.neg, torch.neg), ("neg", "__neg__")),
    "exp": ((torch.exp,), ("exp",)),
    "sum": ((torch.sum,), ("sum",)),
    "log_softmax": ((torch.log_softmax, F.log_softmax, torch.special.log_softmax), ("log_softmax",)),
    "softmax": ((torch.softmax, F.softmax, torch.special.softmax), ("softmax",)),
    "logsumexp": ((torch.logsumexp, torch.special.logsumexp), ("logsumexp",)),
    "gather": ((torch.gather,), ("gather",)),
    "take_along_dim": ((torch.take_along_dim,), ("take_along_dim",)),
    "cross_entropy": ((F.cross_entropy,), ()),
    "nll_loss": ((F.nll_loss,), ()),
    "kl_div": ((F.kl_div,), ()),
}
_BY_FUNCTION = {fn: name for name, (fns, _) in _SPELLINGS.items() for fn in fns}
_BY_METHOD = {m: name for name, (_, methods) in _SPELLINGS.items() for m in methods}

# Parameter names after the tensor input, per canonical op (torch's own names).
_PARAMS: dict[str, tuple[str, ...]] = {
    "div": ("other",),
    "mul": ("other",),
    "sub": ("other", "alpha"),
    "sum": ("dim", "keepdim", "dtype"),
    "log_softmax": ("dim", "_stacklevel", "dtype"),
    "softmax": ("dim", "_stacklevel", "dtype"),
    "logsumexp": ("dim", "keepdim"),
    "gather": ("dim", "index", "sparse_grad"),
    "take_along_dim": ("indices", "dim"),
    "cross_entropy": ("target", "weight", "size_average", "ignore_index", "reduce",
                      "reduction", "label_smoothing"),
    "nll_loss": ("target", "weight", "size_average", "ignore_index", "reduce", "reduction"),
    "reshape": ("shape",),
    "flatten": ("start_dim", "end_dim"),
    "getitem": ("index",),
}
# torch.softmax / torch.log_softmax name the dim positionally only; the methods accept
# ``dtype`` as the second positional argument.
_METHOD_PARAMS: dict[str, tuple[str, ...]] = {
    "log_softmax": ("dim", "dtype"),
    "softmax": ("dim", "dtype"),
}


# Python operator names -> ATen's
_ATEN_NAMES = {"truediv": "div", "floordiv": "floor_divide", "and_": "bitwise_and", "and": "bitwise_and",
               "or_": "bitwise_or", "or": "bitwise_or", "xor": "bitwise_xor", "invert": "bitwise_not",
               "inv": "bitwise_not", "mod": "remainder", "pos": "positive", "logsigmoid": "log_sigmoid",
               "greater": "gt", "less": "lt", "greater_equal": "ge", "less_equal": "le", "not_equal": "ne"}
# reflected dunders (``2 * x`` is ``x.__rmul__(2)``): the same op ("rsub" is ATen's own)
_REFLECTED = {"radd", "rmul", "rtruediv", "rfloordiv", "rpow", "rand", "ror", "rxor", "rmod"}


def op_name(node: Node) -> str:
    """ATen's name for what ``node`` calls (``x < y`` -> "lt", ``F.softmax`` -> "softmax")."""
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function":
        name = getattr(node.target, "__name__", "")
    else:
        return ""
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        name = name[1:] if name in _REFLECTED else name
    return _ATEN_NAMES.get(name, name)


def same(a: Any, b: Any) -> bool:
    """Are sizes ``a`` and ``b`` equal for every value of their symbols?"""
    return statically_known_true(a == b) if not (isinstance(a, int) and isinstance(b, int)) else a == b


def same_shape(a: Any, b: Any) -> bool:
    """Are shapes ``a`` and ``b`` equal for every value of their symbols?"""
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


# ATen names that spell one canonical op of the matcher (everything else: ATen's own name)
_ALIASES = {"float": "convert", "to": "convert", "type": "convert", "view": "reshape", "true_divide": "div",
            "special_log_softmax": "log_softmax", "special_softmax": "softmax",
            "special_logsumexp": "logsumexp"}


def canon(node: Node) -> Optional[str]:
    """The canonical op name of ``node`` (:func:`op_name`, with the spellings of one op
    merged: ``x.float()`` / ``x.to(..)`` -> "convert", ``view`` -> "reshape"), or None for a
    call that is not one of the matcher's known spellings (``_SPELLINGS``, by identity)."""
    try:
        known = node.target in _BY_FUNCTION if node.op == "call_function" else (
            node.op == "call_method" and node.target in _BY_METHOD)
    except TypeError:  # unhashable target
        return None
    if not known:
        return None
    name = op_name(node)
    return _ALIASES.get(name, name)


def tensor_input(node: Node) -> Any:
    """The first (self / input) argument."""
    if node.args:
        return node.args[0]
    return node.kwargs.get("input", node.kwargs.get("self"))


def get_arg(node: Node, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a canonical op, positional or keyword."""
    if name in node.kwargs:
        return node.kwargs[name]
    op = canon(node)
    params = _PARAMS.get(op, ())
    if node.op == "call_method" and op in _METHOD_PARAMS:
        params = _METHOD_PARAMS[op]
    if name in params:
        pos = 1 + params.index(name)
        if pos < len(node.args):
            return node.args[pos]
    return default


def bound_args(node: Node) -> dict[str, Any]:
    """The arguments of a call of a Python function (an emitted call) by parameter name,
    defaults filled in (a ``*args`` parameter: the tuple)."""
    found = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    found.apply_defaults()
    return dict(found.arguments)


def meta(value: Any) -> Any:
    """The example value of a node (Dynamo's ``example_value`` or AOT's ``val``)."""
    if isinstance(value, Node):
        if "example_value" in value.meta:
            return value.meta["example_value"]
        return value.meta.get("val")
    return value


def is_number(value: Any) -> bool:
    """A Python number written into the graph (an int or a float; a bool is no scale)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_scalar(value: Any) -> bool:
    """A number, written in or computed by the graph (``dynamic=True`` makes a
    temperature a ``SymFloat``)."""
    v = meta(value)
    return is_number(v) or isinstance(v, (torch.SymFloat, torch.SymInt))


def scalar_tensor(graph: Graph, node: Node, like: Optional[Node] = None) -> Node:
    """A node computing the symbolic scalar ``node`` as the 0-d tensor a custom op takes
    (before the graph's insertion point): FP32 for a float (the FP32 ops it meets compute
    with it in FP32 either way), int64 for an int; on ``like``'s device (the call's
    tensors': no host tensor in a graph CUDA graphs capture)."""
    dtype = torch.float32 if isinstance(meta(node), (torch.SymFloat, float)) else torch.int64
    kwargs = {"dtype": dtype}
    device = getattr(meta(like), "device", None) if like is not None else None
    if device is not None:
        kwargs["device"] = device
    return graph.call_function(torch.scalar_tensor, (node,), kwargs)


def scaled_by_number(node: Node) -> Optional[tuple[Node, Any, str]]:
    """``(t, c, op)`` for ``t / c``, ``t * c`` or ``c * t`` with ``c`` a number written in
    the graph and ``op`` "div" or "mul"; else None."""
    op = canon(node)
    if op not in ("div", "mul") or get_arg(node, "rounding_mode") is not None:
        return None
    a, b = tensor_input(node), get_arg(node, "other")
    if isinstance(a, Node) and is_number(b):
        return a, b, op
    if op == "mul" and is_number(a) and isinstance(b, Node):
        return b, a, op
    return None


def is_low_precision(value: Any) -> bool:
    v = meta(value)
    return isinstance(v, torch.Tensor) and v.dtype in LOW_PRECISION


def requires_grad(value: Any) -> bool:
    """Does ``value``'s example tensor require grad (as Dynamo traced it)?"""
    v = meta(value)
    return isinstance(v, torch.Tensor) and v.requires_grad


def is_fp32(value: Any) -> bool:
    v = meta(value)
    return isinstance(v, torch.Tensor) and v.dtype == torch.float32


_METADATA_METHODS = {"size", "dim", "numel", "stride", "ndimension", "nelement", "get_device"}
_METADATA_FUNCTIONS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default,
                       torch.ops.aten.sym_stride.int}


def is_metadata_query(node: Node) -> bool:
    """``t.size(...)``, ``t.shape`` and friends: they read no element of ``t``."""
    if node.op == "call_method":
        return node.target in _METADATA_METHODS
    if node.op == "call_function":
        if node.target in _METADATA_FUNCTIONS:
            return True
        if node.target is getattr and len(node.args) > 1:
            return node.args[1] in {"shape", "dtype", "device", "ndim", "is_cuda"}
    return False


# ``t.T``, ``t.mT``, ``t.H``, ``t.mH``: Dynamo records ``getattr(t, "T")`` up to torch 2.13
# and the ATen op from torch 2.14 on (``torch.ops.aten.numpy_T(t)``).
_ATTRIBUTE_VIEW_OPS = {"T": torch.ops.aten.numpy_T, "mT": torch.ops.aten.mT, "H": torch.ops.aten.matrix_H,
                       "mH": torch.ops.aten.mH}
_ATTRIBUTE_VIEWS = {op: name for name, packet in _ATTRIBUTE_VIEW_OPS.items()
                    for op in (packet, packet.default)}


def attribute_view(node: Any) -> Optional[str]:
    """``"T"``, ``"mT"``, ``"H"`` or ``"mH"`` when ``node`` is that view of its first
    argument, in either of Dynamo's spellings; else None."""
    if not isinstance(node, Node) or node.op != "call_function" or not node.args:
        return None
    if node.target is getattr:
        return node.args[1] if len(node.args) == 2 and node.args[1] in _ATTRIBUTE_VIEW_OPS else None
    return _ATTRIBUTE_VIEWS.get(node.target) if len(node.args) == 1 and not node.kwargs else None


# Calls whose only effect is telemetry; Dynamo keeps them in the graph (e.g. a loss
# module built inside the compiled code logs its construction), they touch no tensor.
_TELEMETRY = compat.TELEMETRY_FUNCTIONS


def is_pure(node: Node) -> bool:
    """Safe to move: a call that computes a value from its inputs, with no side effect
    (neither :func:`mutates` nor :func:`is_mode_switch`)."""
    return node.op in ("call_function", "call_method") and not mutates(node) and not is_mode_switch(node)


GRAD_SWITCH = torch._C._set_grad_enabled
MODE_OPENERS = {"_enter_autocast": "autocast", "_enter_inference_mode": "inference_mode"}
MODE_CLOSERS = {"_exit_autocast", "_exit_inference_mode"}


_IN_PLACE_OPERATORS = {operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
                       operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                       operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}


_IN_PLACE_DUNDERS = {f"__{op.__name__}__" for op in _IN_PLACE_OPERATORS}


def call_name(node: Node) -> str:
    return getattr(node.target, "__name__", "") if node.op == "call_function" else ""


def is_mode_switch(node: Node) -> bool:
    """A grad-mode, autocast or inference-mode switch (a call that changes no tensor)."""
    return node.op == "call_function" and (
        node.target is GRAD_SWITCH or call_name(node) in MODE_OPENERS or call_name(node) in MODE_CLOSERS)


def mutates(node: Node) -> bool:
    """Can ``node`` change a tensor in place, or have another side effect?  In-place
    methods (``x.mul_(2)``), ``x[i] = v``, ``torch.relu_``, and any call FX or the name
    marks impure; not mode switches (see :func:`states`) nor telemetry calls."""
    if node.op == "call_method":
        target = str(node.target)
        if target.startswith("__"):  # __iadd__, __setitem__ ... change self; __and__ does not
            return target in _IN_PLACE_DUNDERS
        return target.endswith("_")
    if node.op == "call_module":
        return True
    if node.op != "call_function" or is_mode_switch(node) or node.target in _TELEMETRY:
        return False
    if node.target in _IN_PLACE_OPERATORS or node.is_impure():
        return True
    if getattr(node.target, "__module__", None) in ("_operator", "operator"):
        return False  # operator.and_, operator.or_ ...: out of place despite the name
    name = call_name(node)
    return name.endswith("_") or name.startswith("_")


def last_dim(dim: Any, ndim: int) -> bool:
    """True when ``dim`` (int, or a one-element list/tuple) names the last dim."""
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and not isinstance(dim, bool) and dim in (-1, ndim - 1)


def is_collective(node: Node) -> bool:
    """A functional collective (``torch.ops._c10d_functional.*``: all_reduce, wait_tensor ...)."""
    ops = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
    return (node.op == "call_function" and isinstance(node.target, ops)
            and str(node.target).startswith("_c10d_functional."))


# Elementwise ops a vocab-parallel region may apply to FP32 logits (functions, Tensor methods).
_ELEMENTWISE_FUNCTIONS = {
    operator.truediv: "div", torch.div: "div", operator.mul: "mul", torch.mul: "mul",
    operator.sub: "sub", torch.sub: "sub", operator.add: "add", torch.add: "add",
    operator.neg: "neg", torch.neg: "neg", torch.exp: "exp", torch.log: "log", torch.tanh: "tanh",
    torch.where: "where", torch.detach: "detach", torch.clamp: "clamp", torch.maximum: "maximum",
    torch.minimum: "minimum",
}
_ELEMENTWISE_METHODS = {
    "div", "__truediv__", "mul", "__mul__", "__rmul__", "sub", "__sub__", "__rsub__", "add",
    "__add__", "__radd__", "neg", "__neg__", "exp", "log", "tanh", "detach", "clamp", "clamp_min",
    "clamp_max", "maximum", "minimum", "float", "to", "contiguous",
}


def is_elementwise(node: Node) -> bool:
    """An op that maps each element on its own (a vocab-parallel region's FP32 steps)."""
    if node.op == "call_method":
        return node.target in _ELEMENTWISE_METHODS
    if node.op == "call_function":
        try:
            return node.target in _ELEMENTWISE_FUNCTIONS
        except TypeError:
            return False
    return False


def keep_meta(new: Node, old: Node) -> None:
    """Give ``new``, which replaces ``old``, its example value and source location."""
    new.meta.update({k: v for k, v in old.meta.items() if k in ("example_value", "val", "stack_trace")})


def graph_snapshot(graph: Graph) -> Graph:
    """A copy of ``graph``'s nodes (placeholders included) for :func:`restore_graph`."""
    snapshot = Graph()
    snapshot.output(snapshot.graph_copy(graph, {}))
    return snapshot


def restore_graph(graph: Graph, snapshot: Graph) -> None:
    """Put ``snapshot``'s nodes back into ``graph`` in place (the caller holds this graph
    object), keeping ``graph``'s own placeholders: Dynamo hangs attributes on them
    (``_dynamo_source``) that AOTAutograd asserts, and the passes never touch them."""
    for node in reversed(list(graph.nodes)):
        if node.op != "placeholder":
            graph.erase_node(node)
    ours = [n for n in graph.nodes if n.op == "placeholder"]
    theirs = [n for n in snapshot.nodes if n.op == "placeholder"]
    out = graph.graph_copy(snapshot, dict(zip(theirs, ours)))
    graph.output(out)
