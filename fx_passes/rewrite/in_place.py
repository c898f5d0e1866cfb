"""In-place maths on the fresh FP32 copy of the logits, made out of place.

``logits = logits.to(torch.float32); logits.div_(t)`` (a temperature applied in place, as
OpenRLHF does) changes a tensor that the graph itself has just made and that nothing has
read yet: the same as ``logits = logits.to(torch.float32).div(t)``, which the matchers
take.  NOTE [fresh in place].
"""

# NOTE [fresh in place]
# ``y.op_(..)`` is replaced by ``v = y.op(..)``, and every later reader of ``y`` (and of the
# in-place call's result, an alias of ``y``) reads ``v`` instead, when
#
# * ``y`` is fresh: an FP32 upcast of model-precision logits (a dtype change always copies,
#   so ``y`` aliases no input), or the result of a call made out of place here;
# * the in-place call is ``y``'s first reader in graph order: nothing read ``y`` (or took a
#   view of it) before, so nothing could see the values change;
# * ``op`` is pointwise (ATen's tag) and ``y.op(..)`` has ``y``'s dtype and shape (an
#   in-place op keeps them; out of place, an FP64 operand would promote the result).
#
# After the call ``y`` and ``v`` hold the same values, and each reader after it reads one
# name for them: the program computes what it computed.

from __future__ import annotations

import logging
import operator
from typing import Optional

import torch
from torch.fx import Graph, Node

from ..fx.graph_ops import meta, same_shape
from ..fx.op_rules import pointwise_op
from ..match.upcast import upcast_input
from .row_slices import example_value

__all__ = ["out_of_place"]

log = logging.getLogger(__name__)

_OPERATORS = {operator.iadd: "add", operator.isub: "sub", operator.imul: "mul", operator.itruediv: "div"}


def _out_of_place_name(node: Node) -> Optional[str]:
    """The out-of-place method of the in-place call ``node``, else None."""
    if node.op == "call_function" and node.target in _OPERATORS:
        return _OPERATORS[node.target]
    if node.op != "call_method" or str(node.target).startswith("__") or not str(node.target).endswith("_"):
        return None
    name = str(node.target)[:-1]
    return name if pointwise_op(name) else None


def _first_reader(y: Node, order: dict[Node, int]) -> Optional[Node]:
    return min(y.users, key=order.__getitem__, default=None)


def _one(graph: Graph, call: Node, name: str) -> Optional[Node]:
    y = call.args[0]
    try:
        value = example_value("call_method", name, call.args, dict(call.kwargs))
    except Exception:  # (an operand the out-of-place form does not take)
        return None
    want = meta(y)
    if not (isinstance(value, torch.Tensor) and value.dtype == want.dtype
            and same_shape(value.shape, want.shape)):
        return None
    with graph.inserting_before(call):
        v = graph.call_method(name, call.args, dict(call.kwargs))
    v.meta.update({k: w for k, w in call.meta.items() if k in ("stack_trace", "nn_module_stack")})
    v.meta["example_value"] = value
    order = {n: i for i, n in enumerate(graph.nodes)}
    later = [u for u in y.users if u is not call and order[u] > order[call]]
    for u in later:
        u.replace_input_with(y, v)
    call.replace_all_uses_with(v)
    graph.erase_node(call)
    return v


def out_of_place(graph: Graph) -> int:
    """Make the in-place calls of NOTE [fresh in place] out of place; how many were."""
    fresh = [n for n in graph.nodes if upcast_input(n) is not None]
    done = 0
    while fresh:
        y = fresh.pop()
        call = _first_reader(y, {n: i for i, n in enumerate(graph.nodes)})
        name = _out_of_place_name(call) if call is not None and call.args and call.args[0] is y else None
        if name is None or y in call.args[1:] or y in call.kwargs.values():
            continue
        v = _one(graph, call, name)
        if v is not None:
            log.info("chunked_logits: %s made out of place: %s is a fresh FP32 copy nothing read before",
                     call.name, y.name)
            done += 1
            fresh.append(v)
    return done
