"""Roundings to 16 bits that stock Inductor's fused kernels skip and a chunk loop would not.

Stock Inductor runs a cast to bf16 / fp16 inside the fused kernel that reads it, and keeps
the value in FP32 there; a chunk loop that runs the op as written, or reads a 16-bit tensor
the graph stores, rounds it.  The two predicates here say which nodes do that, for the
loss tail's derivation (:mod:`fx_passes.match.loss_tail`, NOTE [16-bit roundings in a
tail]) and the row-local regions (:mod:`fx_passes.match.row_local`, NOTE [16-bit roundings
in a row-local body]): a node that makes a 16-bit value (:func:`rounds_to_16_bits`), and a
16-bit tensor the graph computes (:func:`computed_short`).
"""

# NOTE [16-bit roundings in a row-local body]
# A row-local region's body is its own compiled graph: a 16-bit value it hands back to the
# graph is stored rounded (``kl.bfloat16()`` before a ``sum(dtype=torch.float32)``), and a
# 16-bit tensor the graph computes is read as the graph stored it (``kl * adv.bfloat16()``:
# ``adv`` rounded), where stock's one fused kernel keeps both in FP32 (a loss further from
# FP64 than stock's, ``tests/test_row_local_16bit.py``).  So an op that makes a 16-bit value
# (not one that keeps the value, not a converted bool: :func:`rounds_to_16_bits`) or reads a
# 16-bit tensor the graph computes (:func:`computed_short`) stays out of the region: it runs
# in the graph, for Inductor, on the region's FP32 per-row result, exactly as stock runs it.
# When it reads an FP32 ``[rows, .., V]`` tensor of the region instead (no per-row result to
# leave it after), the region is declined, the op named in the log.  A 16-bit graph input,
# read as it is (through views too), is its own exact value: taken.

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Node

from ..fx.graph_ops import canon, meta, op_name
from ..fx.op_rules import TAIL_ROWS, Kind

__all__ = ["SHORT", "VIEWS", "KEEPS_VALUE", "rounds_to_16_bits", "computed_short"]

# Views that keep the row-major order of the values (one per row): identities on the flat rows.
VIEWS = {name for name, kind in TAIL_ROWS.items() if kind is Kind.ROW_VIEW}
# 16-bit dtypes; ops that keep a 16-bit value exactly; conversions (a bool's is exact)
SHORT = (torch.float16, torch.bfloat16)
KEEPS_VALUE = VIEWS | {"detach", "clone", "contiguous", "positive", "neg"}
CONVERSIONS = {name for name, kind in TAIL_ROWS.items() if kind is Kind.PER_ROW} - {"detach", "clone"}


def _tensor(value: object) -> Optional[torch.Tensor]:
    v = meta(value)
    return v if isinstance(v, torch.Tensor) else None


def _from_bool(node: Node, name: str) -> bool:
    """Is ``node`` a conversion of a bool tensor (exact in any floating dtype)?"""
    src = _tensor(node.args[0]) if node.args and isinstance(node.args[0], Node) else None
    return (name in CONVERSIONS or canon(node) == "convert") and src is not None and src.dtype == torch.bool


def rounds_to_16_bits(node: Node) -> Optional[torch.dtype]:
    """The 16-bit dtype ``node`` rounds a value to, or None: a node that makes a bf16 /
    fp16 tensor, unless its op keeps the value as it is (a view, ``neg``, ...) or converts
    a bool."""
    out, name = _tensor(node), op_name(node)
    if out is None or out.dtype not in SHORT or name in KEEPS_VALUE or _from_bool(node, name):
        return None
    return out.dtype


def computed_short(a: Node) -> bool:
    """Is ``a`` a 16-bit floating tensor the graph computes (not an input read as it is,
    through views, nor a converted bool)?"""
    t = _tensor(a)
    if t is None or t.dtype not in SHORT:
        return False
    while a.op in ("call_function", "call_method") and op_name(a) in KEEPS_VALUE and a.args \
            and isinstance(a.args[0], Node):
        a = a.args[0]
    return a.op not in ("placeholder", "get_attr") and not _from_bool(a, op_name(a))
