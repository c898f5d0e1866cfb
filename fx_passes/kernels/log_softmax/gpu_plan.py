"""The lm_head backward's ``"gpu"`` plan: model-precision GEMM inputs only, FP32 sums
through ``out_dtype`` (``tiling.backward_plan``).

Never makes an FP32 copy of an operand; each gradient element is still one FP32 sum
rounded to model precision once.  ``tests/test_gemm_audit.py`` records the GEMMs;
``docs/gemms.md`` has the counts of every plan.  See NOTE [gpu plan].
"""

# NOTE [gpu plan]
# On a tensor-core GPU a GEMM with FP32 inputs runs many times slower than one with bf16
# inputs (TF32 off), so this plan never makes an FP32 copy of an operand.  Each gradient
# element is still one FP32 sum rounded to model precision once:
#
# * ``grad_weight[block]`` (a sum over the rows) is one GEMM over all rows (K = T), which
#   accumulates in FP32 inside and rounds its output once;
# * ``grad_hidden[rows]`` (a sum over the vocabulary, which spans the blocks) is
#   accumulated across the blocks by GEMMs with an FP32 output into an FP32 ``[S, H]``
#   buffer, rounded once at the end: the first block's GEMM writes it
#   (``torch.mm(g, w_block, out_dtype=torch.float32, out=acc)``: no zero-fill), every later
#   one adds into it inside the GEMM (``torch.addmm(acc, g, w_block, out_dtype=..., out=acc)``).
#
# Per step that is four ``[T, H] x [H, V]`` GEMMs with the forward's (forward, recompute,
# ``grad_weight``, ``grad_hidden``) when the buffer holds all rows (``S = T``: the budget's
# half holds ``4 T H`` bytes, which a GPU's default budget does at any common T).  Past
# that, each further group of ``S`` rows takes a sweep of its own (recompute + its
# ``grad_hidden``), as in the ``"blocks"`` plan.

from __future__ import annotations

from typing import Callable, Optional

import torch

from ... import compat
from ..tiling import accumulator_rows, even_splits, gpu_block_cols, product_cols

__all__ = ["out_dtype_blocks", "fp32_chunk_grads"]

F32 = torch.float32


def out_dtype_blocks(hidden: torch.Tensor, weight: torch.Tensor, budget_bytes: int,
                     grad_of_tile: Callable[[int, int, int, int], torch.Tensor],
                     grad_hidden: Optional[torch.Tensor], grad_weight: Optional[torch.Tensor],
                     grad_bias: Optional[torch.Tensor] = None) -> None:
    """The ``"gpu"`` backward of ``hidden @ weight.T``: ``grad_of_tile(t0, t1, v0, v1)``
    is the model-precision gradient of the logits ``[t0:t1, v0:v1]`` (recomputed).
    Writes ``grad_hidden``, ``grad_weight`` and ``grad_bias``; one given as None is not
    computed (``grad_bias`` goes with ``grad_weight``)."""
    (n, width), vocab = hidden.shape, weight.shape[0]
    if grad_hidden is None:
        groups = [(0, 0)]  # one sweep over all rows, for grad_weight only
        acc = None
    else:
        groups = even_splits(n, accumulator_rows(budget_bytes, n, width)) or [(0, 0)]
        acc = torch.empty(groups[0][1], width, dtype=torch.float32, device=hidden.device)
    for i, (r0, r1) in enumerate(groups):
        with_weight = i == 0 and grad_weight is not None
        t0, t1 = (0, n) if with_weight else (r0, r1)  # the rows this sweep recomputes
        group = acc[:r1 - r0] if acc is not None else None
        if t0 == t1:  # (no rows: no per-block work, zero sums)
            for t in (grad_weight, grad_bias) if with_weight else ():
                if t is not None:
                    t.zero_()
            continue
        for j, (v0, v1) in enumerate(even_splits(vocab, gpu_block_cols(budget_bytes, t1 - t0, vocab))):
            g = grad_of_tile(t0, t1, v0, v1)
            if with_weight:
                torch.mm(g.t(), hidden[t0:t1], out=grad_weight[v0:v1])
                if grad_bias is not None:
                    grad_bias[v0:v1] = g.sum(0, dtype=torch.float32)
            if group is not None and j == 0:  # the first block's GEMM writes the sum (no zero-fill)
                torch.mm(g[r0 - t0:r1 - t0], weight[v0:v1], out_dtype=F32, out=group)
            elif group is not None:  # every later one adds into it inside the GEMM
                compat.addmm_fp32_(group, g[r0 - t0:r1 - t0], weight[v0:v1])
            del g  # (before the next block's logits exist)
        if group is not None:
            grad_hidden[r0:r1] = group


# NOTE [gpu loss chunk]
# The loss in the graph (``loss._loop``, ``"gpu"``): each row chunk's logits gradient ``g``
# (model precision, written over the chunk's logits by the chunk's one row kernel) feeds two
# GEMMs with model-precision inputs and FP32 outputs, and nothing else touches the FP32
# sums between the GEMMs:
#
# * ``grad_hidden[chunk] = g @ W``: ``torch.mm(g, W, out_dtype=F32, out=grad_h[rows])``,
#   the whole sum over the vocabulary inside the one GEMM, written into its rows;
# * ``grad_weight``: the first chunk's GEMM *writes* the FP32 ``[V, H]`` accumulator
#   (``torch.mm(g.t(), h, out_dtype=F32, out=acc)``: beta 0, no zero-fill kernel), every
#   later chunk's *adds* into it inside the GEMM (``torch.addmm(acc, g.t(), h,
#   out_dtype=F32, out=acc)``: the epilogue's read, no separate read-modify-write).
#
# The backward rounds each FP32 sum once (times the incoming gradient).  Where this
# torch's ``addmm`` cannot write an FP32 ``out`` from model-precision inputs
# (``compat.probe_addmm_into``), a later chunk adds an FP32 product of at most ``cols``
# columns (``tiling.product_cols``) instead.


def fp32_chunk_grads(g: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, grad_h: Optional[torch.Tensor],
                     grad_w: Optional[torch.Tensor], grad_b: Optional[torch.Tensor], first: bool,
                     budget_bytes: int) -> None:
    """One row chunk of the ``"gpu"`` loss loop (NOTE [gpu loss chunk]): ``g`` the logits
    gradient of the rows ``h``; ``grad_h`` (FP32, the chunk's rows) written; ``grad_w`` /
    ``grad_b`` (FP32, all of the vocabulary) written when ``first``, else added to; None:
    not wanted."""
    if grad_h is not None:
        torch.mm(g, weight, out_dtype=F32, out=grad_h)
    if grad_w is not None:
        if first:
            torch.mm(g.t(), h, out_dtype=F32, out=grad_w)
        elif compat.probe_addmm_into(g.device, g.dtype):
            compat.addmm_fp32_(grad_w, g.t(), h)
        else:
            for v0, v1 in even_splits(weight.shape[0], product_cols(budget_bytes, *weight.shape)):
                compat.addmm_fp32_(grad_w[v0:v1], g[:, v0:v1].t(), h)
    if grad_b is not None:
        if first:
            torch.sum(g, 0, dtype=F32, out=grad_b)
        else:
            grad_b += g.sum(0, dtype=F32)
