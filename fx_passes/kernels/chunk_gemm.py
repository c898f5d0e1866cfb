"""The logits of row chunks against one weight: ``hidden[a:b] @ weight.T (+ bias)``,
chunk after chunk.

:func:`row_chunk_logits` returns each chunk's logits equal to ``F.linear``'s.  On an x86-64
CPU with oneDNN's bf16 kernels, in bf16, for ``MIN_CHUNKS`` chunks or more, it reorders the
weight once a loop (``mkldnn._reorder_linear_weight``) and runs each chunk as
``mkldnn._linear_pointwise``; the reordered copy (``2 V H`` bytes) lives for the loop only.
Elsewhere, or where the reorder raises (said once in the log), each chunk is the graph's
own op.  Why, and what it costs and saves: docs/gemms.md, "The weight reordered once a loop".
"""

from __future__ import annotations

import functools
import logging
import platform
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..reporting.report import say_once

__all__ = ["row_chunk_logits", "logits", "head_logits", "MIN_CHUNKS", "reorders"]

# (the reorder: 60 ms at WD's size in profile_step.py; the packing inside every call it
# saves: 0.14 s over 32 chunks in gemm_floor.py, 4 ms a chunk: even at about 14 chunks)
MIN_CHUNKS = 16


def logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           how: str) -> torch.Tensor:
    """The lm_head's op as the graph had it: ``F.linear`` or ``hidden @ weight.T``."""
    return F.linear(hidden, weight, bias) if how == "linear" else torch.matmul(hidden, weight.t())


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], how: str,
                flatten: bool = False) -> torch.Tensor:
    """:func:`logits`, its rows flattened to ``[N, V]`` with ``flatten``."""
    x = logits(hidden, weight, bias, how)
    return x.flatten(0, -2) if flatten else x


def reorders(weight: torch.Tensor, bias: Optional[torch.Tensor], chunks: int) -> bool:
    """Whether a loop of ``chunks`` row chunks against ``weight`` reorders it once."""
    return (chunks >= MIN_CHUNKS and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.dim() == 1)) and _onednn_bf16())


@functools.lru_cache(None)
def _onednn_bf16() -> bool:
    """oneDNN with bf16 kernels on an x86-64 CPU (where the reorder is tested)."""
    return (platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _say_not_reordered(why: str) -> None:
    say_once(logging.WARNING, "chunked_logits: the lm_head weight could not be reordered for its chunk loop "
             "(%s): each chunk runs the graph's op (same results)", why)


def row_chunk_logits(weight: torch.Tensor, bias: Optional[torch.Tensor], how: str, spans: list,
                     allowed: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """``f(hidden[a:b])`` -> that chunk's logits, for a loop over the row ``spans``
    (reordered for the first one's rows); ``allowed`` False (the step holds no ``[V, H]``
    tensor later): the op."""
    if not (allowed and reorders(weight, bias, len(spans))):
        return lambda h: logits(h, weight, bias, how)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, spans[0][1] - spans[0][0])
    except Exception as e:  # noqa: BLE001 - a oneDNN that cannot: the op, as without it
        _say_not_reordered(f"{type(e).__name__}: {e}")
        return lambda h: logits(h, weight, bias, how)
    return lambda h: torch.ops.mkldnn._linear_pointwise(h, packed, bias, "none", [], "")
