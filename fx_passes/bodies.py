"""The lm_head loop's per-chunk bodies, each compiled by Inductor once.

The loops of :mod:`fx_passes.lm_head` run in Python; what they call per row chunk
(forward) and per vocabulary block x row tile (backward) is a small function of plain
torch ops compiled here (``dynamic=True``), so generated kernels carry the hot path.
The maths is :mod:`fx_passes.ops`'s, applied to logits formed by the chunk's matmul.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import compat
from .ops import grad_of_logits, stats_of_logits

__all__ = ["compiled", "forward_chunk", "backward_block"]


@functools.lru_cache(None)
def compiled(fn):
    """``fn`` compiled once: detached inputs, one dispatch-key set, no_grad."""
    # emulate_precision_casts: round the logits to the model dtype where the bodies say
    # so (``.to(dtype)``), as the unfused graph does; without it Inductor keeps FP32 in
    # registers, and the backward's recomputed logits would not match the forward's lse.
    body = torch.compile(fn, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})

    @functools.wraps(fn)
    def call(*args):
        # The op's first call and later ones can see different requires_grad flags,
        # thread-local dispatch-key sets and grad modes (Dynamo guards on all three):
        # detached tensors, one key set and no_grad, so each body compiles once.
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        with compat.below_autograd():
            return body(*args)
    return call


def forward_chunk(h, w, b, tokens, scale, is_div: bool, want_entropy: bool):
    """(lse, logprob or None, entropy or None) of this chunk's rows: the logits are
    computed in model precision, then reduced as the unfused region reduces them."""
    return stats_of_logits(F.linear(h, w, b).to(h.dtype), tokens, scale, is_div, want_entropy)


def backward_block(h, w, b, tokens, lse, entropy, g_lse, g_logprob, g_entropy, scale, is_div: bool,
                   dtype: torch.dtype):
    """Model-precision gradient of this block's logits.

    ``h``/``w``/``b`` may be FP32 copies of the model-precision operands (see
    ``tiling.fp32_gemm``): the logits are rounded to ``dtype`` as the forward's were.
    """
    logits = F.linear(h, w, b).to(dtype)
    return grad_of_logits(logits, tokens, lse, entropy, g_lse, g_logprob, g_entropy, scale, is_div)
