"""Find the lm_head matmul that makes a region's logits.

A region's logits are ``hidden @ weight.T`` (``linear`` / ``matmul``, with or without
bias) when this module says so: then the rewrite calls
:func:`fx_passes.kernels.log_softmax.lm_head.lm_head_row_stats` on ``hidden`` and the logits never exist.
A chain of constant scalings and ``tanh`` between the matmul and the upcast is carried into
the loop (``LMHead.transforms``); logits the graph also returns are written by the loop
(``LMHead.returned``); anything else keeps the matmul whole, the reason naming the op.
See NOTE [lm_head transforms].
"""

# NOTE [lm_head transforms]
# Between the matmul and the upcast some model families transform the logits in
# model precision: Gemma2 softcaps them (``tanh(x / c) * c``), Granite divides them by
# ``logits_scaling``, Cohere multiplies them by ``logit_scale``.  Such a chain of
# divisions and multiplications by constants and ``tanh`` is carried into the chunk
# loop (``LMHead.transforms``, applied per chunk exactly as the model rounds them); any
# other op there keeps the matmul whole, and the reason names the op.
#
# When the graph also returns the logits (Hugging Face models do), the loop writes them
# as a fourth result (``LMHead.returned``): the lm_head still fuses when the graph output
# is their only reader besides the region, and the region reads every row of them.  The
# backward then adds the returned logits' gradient per tile instead of forming the
# region's whole ``[T, V]`` gradient.

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.fx import Node

from ..fx.graph_ops import (
    attribute_view,
    canon,
    is_low_precision,
    meta,
    op_name,
    scaled_by_number,
    tensor_input,
)
from .upcast import is_row_view

__all__ = ["LMHead", "match_lm_head", "producer", "from_lm_head", "model_precision_operands",
           "NOT_MODEL_PRECISION", "READ_ELSEWHERE", "FUSION_OFF", "TRANSFORMS_KNOWN"]

TRANSFORMS_KNOWN = "x / c, x * c and tanh(x), c a constant"
_MAX_TRANSFORMS = 8  # how far back from the upcast the logit transforms are followed


@dataclasses.dataclass
class LMHead:
    logits: Node  # the matmul / linear node, erased by the rewrite
    hidden: Node
    weight: Node  # [V, H]
    bias: Optional[Node]
    transpose: Optional[Node]  # the weight.T node of a matmul form, erased if unused
    chain: tuple[Node, ...] = ()  # the logit transforms' nodes, matmul side first, erased too
    transforms: str = ""  # their encoding for the op: "div:<c>,tanh,mul:<c>" (float.hex)
    returned: bool = False  # the graph returns the logits too: the loop writes them
    views: tuple[Node, ...] = ()  # row slices of the logits before the upcast ([:, :-1]), done on hidden


_SWAPS = ((0, 1), (1, 0), (-1, -2), (-2, -1))  # transpose(a, b) of a 2-D weight


def _weight_of_transpose(node) -> Optional[Node]:
    """``W`` when ``node`` is ``W.T`` / ``W.mT`` / ``W.t()`` / ``W.transpose(0, 1)`` (or
    ``torch.t(W)`` / ``torch.transpose(W, 0, 1)``) of a 2-D W."""
    if not isinstance(node, Node) or node.op not in ("call_function", "call_method") or node.kwargs:
        return None
    if attribute_view(node) in ("T", "mT"):  # (getattr up to torch 2.13, aten.numpy_T / aten.mT from 2.14)
        src = node.args[0]
    elif node.target in ("t", torch.t) and len(node.args) == 1:  # (a method's target is its name)
        src = node.args[0]
    elif node.target in ("transpose", torch.transpose) and tuple(node.args[1:]) in _SWAPS:
        src = node.args[0]
    else:
        return None
    v = meta(src)
    return src if isinstance(src, Node) and isinstance(v, torch.Tensor) and v.dim() == 2 else None


def producer(x: Node) -> Optional[LMHead]:
    """The lm_head whose matmul (``linear`` / ``hidden @ weight.T``) is ``x``, or None."""
    if x.op == "call_function" and x.target in (F.linear, torch._C._nn.linear):
        args = list(x.args) + [None] * 3
        hidden, weight = args[0], x.kwargs.get("weight", args[1])
        bias = x.kwargs.get("bias", args[2])
        return LMHead(x, hidden, weight, bias, None)
    is_matmul = (x.op == "call_function" and x.target in (operator.matmul, torch.matmul, torch.mm)) or (
        x.op == "call_method" and x.target in ("matmul", "mm", "__matmul__"))
    if is_matmul and len(x.args) == 2:
        weight = _weight_of_transpose(x.args[1])
        if weight is not None:
            return LMHead(x, x.args[0], weight, None, x.args[1])
    return None


def _transform(node: Node) -> Optional[tuple[Node, str]]:
    """(the logits it reads, its encoding) when ``node`` is a known logit transform."""
    scaled = scaled_by_number(node)
    if scaled is not None:
        return scaled[0], f"{scaled[2]}:{float(scaled[1]).hex()}"
    tanh = (node.op == "call_function" and node.target in (torch.tanh, F.tanh)) or (
        node.op == "call_method" and node.target == "tanh")
    if tanh and len(node.args) == 1 and not node.kwargs and isinstance(node.args[0], Node):
        return node.args[0], "tanh"
    return None


def _elementwise_on(node: Node) -> Optional[Node]:
    """The one tensor ``node`` reads, when it maps it element by element to a tensor of
    the same shape (``sigmoid(x)``, ``x + 1``): an unknown logit transform.  Views and
    ops with other tensor or symbolic operands (masks, per-row scales) are not."""
    inputs = node.all_input_nodes
    if len(inputs) != 1:
        return None
    v, vin = meta(node), meta(inputs[0])
    same = isinstance(v, torch.Tensor) and isinstance(vin, torch.Tensor) and v.shape == vin.shape
    return inputs[0] if same and canon(node) not in ("getitem", "reshape", "flatten", "contiguous") else None


def _unwind(x: Node, reads: set) -> tuple[Optional[LMHead], str]:
    """The lm_head behind ``x`` through known logit transforms; or None with the reason
    (empty when no matmul is near: then ``x`` is simply not an lm_head's output)."""
    chain, specs, node = [], [], x
    for _ in range(_MAX_TRANSFORMS):
        head = producer(node)
        if head is not None:
            break
        step = _transform(node)
        if step is None:
            source = _elementwise_on(node)
            if source is not None and producer(source) is not None:
                return None, (f"the logits pass through {op_name(node)} ({node.name}) between the lm_head "
                              f"and the upcast; the chunk loop carries {TRANSFORMS_KNOWN}")
            return None, ""  # a view, a masked_fill ...: x is not the lm_head's output
        chain.append(node)
        specs.append(step[1])
        node = step[0]
    else:
        return None, ""
    # (the graph output may read the transformed logits too: then the loop writes them)
    shared = any(u not in reads and u.op != "output" for u in x.users) or any(
        len(n.users) != 1 for n in (head.logits, *chain[1:]))
    if chain and shared:
        return None, ""  # the transformed logits feed something else too: x is not the lm_head's output
    head.chain = tuple(reversed(chain))
    head.transforms = ",".join(reversed(specs))
    return head, ""


def _row_slices(x: Any) -> tuple[list[Node], Any]:
    """(the row slices ``x`` is of the lm_head's logits, ``x``'s side first; what they
    slice): ``(h @ w.T)[:, :-1]`` slices the hidden states as well, ``h[:, :-1] @ w.T``."""
    views = []
    while isinstance(x, Node) and canon(x) == "getitem" and isinstance(src := tensor_input(x), Node) \
            and is_row_view(x, src):
        views.append(x)
        x = src
    return views, x


def from_lm_head(x: Node) -> bool:
    """Is ``x`` an lm_head's logits (through known transforms and row slices)?"""
    views, src = _row_slices(x)
    return isinstance(src, Node) and _unwind(src, set(views))[0] is not None


# why the matmul stays whole (rewrite/upcast_region.py and rewrite/row_local.py say them too)
NOT_MODEL_PRECISION = "the matmul's operands are not a model-precision [.., H] x [V, H] lm_head"
READ_ELSEWHERE = "the logits are also used outside the region; the matmul runs once in full"
FUSION_OFF = "fuse_lm_head is off"


def model_precision_operands(head: LMHead, x: Node) -> bool:
    """Are ``head``'s operands a model-precision ``[.., H] x [V, H]`` lm_head (bias
    ``[V]``) of the dtype of its logits ``x`` and of every transform between?"""
    h, w, b = meta(head.hidden), meta(head.weight), meta(head.bias) if head.bias is not None else None
    return (isinstance(h, torch.Tensor) and isinstance(w, torch.Tensor) and w.dim() == 2 and h.dim() >= 1
            and is_low_precision(head.hidden) and h.dtype == w.dtype == meta(x).dtype
            and all(meta(n).dtype == w.dtype for n in head.chain)
            and (b is None or (isinstance(b, torch.Tensor) and b.dim() == 1 and b.dtype == w.dtype)))


def match_lm_head(region) -> tuple[Optional[LMHead], str]:
    """The lm_head producing the region's logits, or None with the reason it stays."""
    x = region.x
    reads = set(region.roles) | ({region.moved_scale} if region.moved_scale is not None else set())
    views, src = _row_slices(x)
    head, why = _unwind(src, reads | set(views)) if isinstance(x, Node) else (None, "")
    if head is None:
        return None, why
    outside = [u for u in x.users if u not in reads]
    sliced_elsewhere = bool(views) and (bool(outside) or any(len(v.users) != 1 for v in [*views[1:], src]))
    if region.meta_users or any(u.op != "output" for u in outside) or sliced_elsewhere:
        return None, READ_ELSEWHERE
    head.returned, head.views = bool(outside), tuple(reversed(views))
    if not model_precision_operands(head, x):
        return None, NOT_MODEL_PRECISION
    for view in region.views:
        if canon(view) in ("reshape", "flatten") and meta(view).dim() != 2:
            return None, f"the row view {view.name} is not a flatten to [N, V]"
        if head.returned and canon(view) == "getitem":
            return None, (f"the graph returns the logits and the region reads a slice of them "
                          f"({view.name}); the matmul runs once in full")
    return head, ""
