"""Find the lm_head matmul that makes a region's logits.

A region's logits are ``hidden @ weight.T`` (``linear`` / ``matmul``, with or without
bias) when this module says so: then the rewrite calls
:func:`fx_passes.lm_head.lm_head_row_stats` on ``hidden`` and the logits never exist.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx import Node

from .graph_ops import canon, is_low_precision, meta

__all__ = ["LMHead", "match_lm_head"]


@dataclasses.dataclass
class LMHead:
    logits: Node  # the matmul / linear node, erased by the rewrite
    hidden: Node
    weight: Node  # [V, H]
    bias: Optional[Node]
    transpose: Optional[Node]  # the weight.T node of a matmul form, erased if unused


def _weight_of_transpose(node) -> Optional[Node]:
    """``W`` when ``node`` is ``W.T`` / ``W.t()`` / ``W.transpose(0, 1)`` of a 2-D W."""
    if not isinstance(node, Node):
        return None
    if node.op == "call_function" and node.target is getattr and node.args[1:] in (("T",), ("mT",)):
        src = node.args[0]
    elif node.op == "call_method" and node.target == "t" and len(node.args) == 1:
        src = node.args[0]
    elif node.op == "call_method" and node.target == "transpose" and tuple(node.args[1:]) in ((0, 1), (1, 0), (-1, -2), (-2, -1)):
        src = node.args[0]
    else:
        return None
    v = meta(src)
    return src if isinstance(src, Node) and isinstance(v, torch.Tensor) and v.dim() == 2 else None


def _producer(x: Node) -> Optional[LMHead]:
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


def match_lm_head(region) -> tuple[Optional[LMHead], str]:
    """The lm_head producing the region's logits, or None with the reason it stays."""
    x = region.x
    head = _producer(x) if isinstance(x, Node) else None
    if head is None:
        return None, ""  # not an lm_head: nothing to say
    reads = set(region.roles) | ({region.moved_scale} if region.moved_scale is not None else set())
    if any(u not in reads for u in x.users) or region.meta_users:
        return None, "the logits are also used outside the region; the matmul runs once in full"
    h, w, b = meta(head.hidden), meta(head.weight), meta(head.bias) if head.bias is not None else None
    ok = (isinstance(h, torch.Tensor) and isinstance(w, torch.Tensor) and w.dim() == 2 and h.dim() >= 1
          and is_low_precision(head.hidden) and h.dtype == w.dtype == meta(x).dtype
          and (b is None or (isinstance(b, torch.Tensor) and b.dim() == 1 and b.dtype == w.dtype)))
    if not ok:
        return None, "the matmul's operands are not a model-precision [.., H] x [V, H] lm_head"
    for view in region.views:
        if canon(view) in ("reshape", "flatten") and meta(view).dim() != 2:
            return None, f"the row view {view.name} is not a flatten to [N, V]"
    return head, ""
