"""The upcast and what leads to it: reading a region's root off a Dynamo graph.

Whether a node upcasts model-precision logits to FP32 (:func:`upcast_input`), the FP32
row views and scalar scalings between an upcast and a head (:func:`is_row_view`,
:func:`scalar_operand`, :func:`walk_back`), the implicit upcast of autocast
(:func:`implicit_root`), an upcast hidden behind an op the pass does not know
(:func:`upcast_behind`), and candidates that are not logits at all (:func:`not_logits`).
:mod:`fx_passes.match.upcast_regions` grows regions from what this module finds."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.fx import Node

from ..fx.graph_ops import canon, get_arg, is_fp32, is_low_precision, is_scalar, last_dim, meta, tensor_input
from ..reporting.report import Decline, Reason, log

__all__ = ["ROW_VIEWS", "HEADS", "upcast_input", "upcast_behind", "is_row_view", "scalar_operand",
           "scaled_operand", "walk_back", "implicit_root", "not_logits", "upcast_ancestor"]

ROW_VIEWS = {"getitem", "reshape", "flatten", "contiguous"}
HEADS = {"log_softmax", "softmax", "logsumexp", "cross_entropy"}


def scalar_operand(node: Node, chain: Node) -> Optional[tuple[Any, bool]]:
    """For ``chain / s`` or ``chain * s`` (either order) with a scalar s: (s, is_div)."""
    op = canon(node)
    if op not in ("div", "mul") or get_arg(node, "rounding_mode") is not None:
        return None
    a, b = tensor_input(node), get_arg(node, "other")
    if op == "div" and a is not chain:
        return None
    other = b if a is chain else a if b is chain else None
    if other is None or other is chain:
        return None
    if isinstance(other, bool):
        raise Decline(Reason.TEMPERATURE, f"boolean operand of {node.name}")
    if is_scalar(other):
        return other, op == "div"
    if isinstance(other, Node):
        v = meta(other)
        if isinstance(v, torch.Tensor):
            if v.dim() != 0 or v.requires_grad or not v.is_floating_point():
                raise Decline(Reason.TEMPERATURE, f"{other.name} has shape {tuple(v.shape)}"
                              f"{' and requires grad' if v.requires_grad else ''}")
            return other, op == "div"
    return None


def is_row_view(node: Node, src: Node) -> bool:
    """A view that only selects or regroups rows, keeping each row's V entries whole."""
    op = canon(node)
    if op not in ROW_VIEWS or tensor_input(node) is not src:
        return False
    vin, vout = meta(src), meta(node)
    if not (isinstance(vin, torch.Tensor) and isinstance(vout, torch.Tensor)) or vout.dim() < 1 \
            or vout.shape[-1] != vin.shape[-1]:  # (a getitem of sort's / topk's tuple is no row view)
        return False
    if op == "getitem":
        index = get_arg(node, "index")
        index = index if isinstance(index, tuple) else (index,)
        if not all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in index):
            return False  # tensor / symbolic indexing
        if Ellipsis in index:
            index = index[index.index(Ellipsis) + 1:]
        else:
            used = [i for i in index if i is not None]
            if len(used) < vin.dim():
                return True
            index = used
        used = [i for i in index if i is not None]
        return not used or used[-1] == slice(None, None, None)
    if op in ("reshape", "flatten"):
        return vout.numel() == vin.numel() and vout.dim() >= 1
    return True  # contiguous


def upcast_input(node: Node) -> Optional[Node]:
    """The model-precision input if ``node`` upcasts it to FP32, else None."""
    if canon(node) != "convert" or not is_fp32(node):
        return None
    src = tensor_input(node)
    if not isinstance(src, Node) or not is_low_precision(src):
        return None
    vin, vout = meta(src), meta(node)
    if vin.shape != vout.shape or vin.device != vout.device:
        return None
    return src


def scaled_operand(node: Node) -> Optional[Node]:
    """The tensor that ``node`` scales by a scalar (``x / s``, ``x * s`` or ``s * x``)."""
    if canon(node) not in ("div", "mul"):
        return None
    for cand in (tensor_input(node), get_arg(node, "other")):
        shape = getattr(meta(cand), "shape", None) if isinstance(cand, Node) else None
        if shape is not None and shape == meta(node).shape:
            try:
                if scalar_operand(node, cand) is not None:
                    return cand
            except Decline:
                return cand  # a scaling the matcher will decline with its reason
    return None


def walk_back(head: Node) -> Node:
    """From a head's input, back through FP32 row views and scalings, to the root."""
    cur = tensor_input(head)
    while isinstance(cur, Node) and is_fp32(cur):
        src = tensor_input(cur)
        if isinstance(src, Node) and is_row_view(cur, src):
            cur = src
            continue
        scaled = scaled_operand(cur)
        if scaled is not None and is_fp32(scaled):
            cur = scaled
            continue
        break
    return cur


def implicit_root(head: Node, upgrade: bool) -> Optional[Node]:
    """The low-precision input of a head that computes in FP32 with no upcast node."""
    src = tensor_input(head)
    if not isinstance(src, Node) or not is_low_precision(src):
        return None
    if is_fp32(head) or (upgrade and is_low_precision(head)):
        return src
    return None


def _upcast_back(node: Node, depth: int, follow: Callable[[Node, Node], bool]) -> Optional[Node]:
    """The nearest upcast of model-precision logits among ``node``'s inputs, breadth
    first up to ``depth`` ops back, through the inputs ``follow(input, reader)`` accepts."""
    frontier, seen = [node], {node}
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for src in n.all_input_nodes:
                if src in seen or not follow(src, n):
                    continue
                if upcast_input(src) is not None:
                    return src
                seen.add(src)
                nxt.append(src)
        frontier = nxt
    return None


def upcast_behind(node: Node, depth: int = 8) -> Optional[Node]:
    """An upcast of model-precision logits that ``node`` (FP32, not itself an upcast)
    is computed from through FP32 tensors of the same shape and row views (``z[:-1]``),
    a few ops back: then an op the pass does not know sits between the upcast and the
    head."""
    def follow(src: Node, reader: Node) -> bool:
        return is_fp32(src) and (getattr(meta(src), "shape", None) == getattr(meta(reader), "shape", None)
                                 or is_row_view(reader, src))
    return _upcast_back(node, depth, follow)


def upcast_ancestor(node: Node, depth: int = 16) -> Optional[Node]:
    """The nearest upcast of model-precision logits that ``node`` is computed from, a few
    ops back through anything (a sort's tuple, a mask): an FP32 tensor inside the region
    of that upcast, declined or rewritten with it, not a region of its own."""
    return _upcast_back(node, depth, lambda src, reader: True)


# Ops that reduce rows over the last dim: a candidate whose FP32 tensors reach none of
# them is not a vocabulary reduction (an attention softmax, an MoE router).
_ROW_REDUCTIONS = {"gather", "take_along_dim", "cross_entropy", "nll_loss", "logsumexp", "kl_div"}


def reduces_rows(root: Node, depth: int = 12) -> bool:
    """Do the tensors computed from ``root`` with its last dim (its ``[.., V]`` family)
    reach a reduction over that dim within ``depth`` ops?  Token log-probs, entropy and
    losses do; attention probabilities (next a matmul with the values, whose last dim
    is the head's) and router weights (next ``topk``) do not."""
    width = getattr(meta(root), "shape", (None,))[-1:]
    frontier, seen = [root], {root}
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                op = canon(u)
                if op in _ROW_REDUCTIONS or (op == "sum" and last_dim(get_arg(u, "dim"), meta(n).dim())):
                    return True
                shape = getattr(meta(u), "shape", None)
                if u not in seen and shape is not None and len(shape) and tuple(shape[-1:]) == tuple(width):
                    seen.add(u)
                    nxt.append(u)
        frontier = nxt
    return False


def not_logits(root: Node, decline: Decline) -> bool:
    """An op the pass does not know reads a candidate that is not a vocabulary reduction
    at all: said at debug level, not counted as a decline (a decline means logits the
    pass saw and could not take)."""
    if decline.reason is not Reason.UNKNOWN_OP or reduces_rows(root):
        return False
    log.debug("chunked_logits: skipped %s: not a reduction over a vocabulary (%s)", root.name, decline)
    return True
