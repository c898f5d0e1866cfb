"""The rows a chunk loop runs: which rows a loss leaves out, found with one host read a step.

:func:`logit_bounds` bounds each row's (transformed, temperature-scaled) logits from the
hidden states and the lm_head weight; :func:`select` turns a boolean "may skip" vector into
the kept rows' indices (None: run every row).  The rows a loss leaves out and the proof
that skipping them is exact are :mod:`fx_passes.match.row_mask`'s.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch._dynamo.utils import counters

from .. import compat
from .log_softmax.bodies import parse_transforms
from .tiling import even_splits, granule

__all__ = ["logit_bounds", "item_bounds", "select", "inside", "COUNTER"]

COUNTER = "chunked_logits"
F64 = torch.float64


def logit_bounds(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 scale: Optional[torch.Tensor], scale_is_div: bool, transforms: str) -> torch.Tensor:
    """Per row of ``hidden`` ``[n, H]``, in FP64: a bound on ``|z|`` over the row's logits
    ``z`` as the lm_head loop forms them (``x = h @ W.T + b`` rounded to the model dtype, the
    ``transforms`` in FP32, then ``/ t`` or ``* t``); inf or NaN where a value might not be
    finite (a NaN or inf anywhere in the operands, a bound past the dtype's range)."""
    x = _abs_sums(hidden) * _largest(weight)
    if bias is not None:
        x = x + _largest(bias)
    x = torch.where(x <= torch.finfo(hidden.dtype).max / 2, x, math.inf)
    for op, c in parse_transforms(transforms):
        x = torch.clamp(x, max=1.0) if op == "tanh" else x / abs(c) if op == "div" else x * abs(c)
    if scale is not None:
        t = scale.double().abs()
        x = x / t if scale_is_div else x * t
    return torch.where(x <= torch.finfo(torch.float32).max / 2, x, math.inf)


_SUM_BLOCK_BYTES = 16 * 2**20  # (the FP64 copy of a block of rows that ``sum(dtype=)`` makes)


def _abs_sums(hidden: torch.Tensor) -> torch.Tensor:
    """``|h|`` summed per row in FP64, by blocks of rows: ``sum(-1, dtype=float64)``
    converts its whole operand first, an FP64 ``[T, H]`` copy (512 MiB at T 16384, H
    4096) where a block's is enough."""
    n, width = hidden.shape[0], max(1, hidden.shape[-1])
    out = torch.empty(n, dtype=F64, device=hidden.device)
    for a, b in even_splits(n, max(1, _SUM_BLOCK_BYTES // (8 * width))):
        torch.sum(hidden[a:b].abs(), -1, dtype=F64, out=out[a:b])
    return out


def _largest(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` in FP64 (NaN if any is): one read of ``x`` (``aminmax``), no ``|x|``
    temporary.  ``x`` is the lm_head weight, ``2 V H`` bytes read every step: ``amax`` then
    ``amin`` read it twice (14 ms against 4 ms at V 32768, H 1024 on one EPYC core)."""
    low, high = torch.aminmax(x)
    return torch.maximum(high, -low).double()


def item_bounds(z: torch.Tensor, vocab: int) -> tuple[torch.Tensor, ...]:
    """Intervals holding ``lse``, ``logprob`` and the entropy per row, from the logits'
    bound ``z``: ``[-z, z + log V]``, ``[-2z - log V, 0]``, ``[0, log V]`` (as
    ``match/row_mask.ITEMS``: each interval's low end, then its high end)."""
    log_v = math.log(vocab)
    zero = torch.zeros_like(z)
    return -z, z + log_v, -2 * z - log_v, zero, zero, zero + log_v


def inside(lo, hi, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(a value of ``dtype`` in ``[lo, hi]``, whether there is one) per row (FP64 ends, or
    numbers): 0 where the interval holds it, else an end that rounds into it.  A skipped
    row's result is written as this value, so the graph's own ops on it compute the zeros
    the skip graph proved for any value of the interval (``match/body_mask.py``)."""
    lo, hi = torch.as_tensor(lo, dtype=F64), torch.as_tensor(hi, dtype=F64)
    a, b = lo.to(dtype), hi.to(dtype)

    def holds(x: torch.Tensor) -> torch.Tensor:
        return (lo <= x.double()) & (x.double() <= hi)
    zero, a_in, b_in = (lo <= 0) & (hi >= 0), holds(a), holds(b)
    return torch.where(zero, 0, torch.where(a_in, a, b)), zero | a_in | b_in


def select(skip: torch.Tensor, rounding: bool = True) -> Optional[torch.Tensor]:
    """The indices of the rows to run (ascending), or None to run them all: ``skip[i]``
    True lets row ``i`` out.  One host read (the count); none, and None, inside a CUDA
    graph capture.  The count is rounded up to a multiple of ``tiling.granule`` (adding
    back skipped rows, which computing makes no less exact) so that chunks stay aligned
    and a step's shapes repeat."""
    n = skip.shape[0]
    if n == 0 or compat._capturing(skip.device.type):
        return None
    order = torch.argsort(skip.to(torch.uint8), stable=True)  # kept rows first, each part in order
    kept = n - int(skip.sum())  # the one host read
    if rounding:
        kept = min(n, -(-kept // granule(kept)) * granule(kept)) if kept else 0
    counters[COUNTER]["rows_seen"] += n
    counters[COUNTER]["rows_skipped"] += n - kept
    if kept == n:
        return None
    return order[:kept].sort().values
