"""The lm_head loop's per-chunk bodies, each compiled by Inductor once.

The loops of :mod:`fx_passes.kernels.log_softmax.lm_head` run in Python; what they call per row chunk
(forward) and per vocabulary block x row tile (backward) is a small function of plain
torch ops compiled here (``dynamic=True``), so generated kernels carry the hot path.
The maths is :mod:`fx_passes.kernels.log_softmax.given`'s, applied to logits formed by the chunk's matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.args import Cotangents, LogitMap, RowValues
from ..ops.body_compiler import compile_body
from .given import grad_of_logits, stats_and_residual

__all__ = ["compiled", "forward_chunk", "forward_chunk_logits", "backward_block", "parse_transforms",
           "transformed", "grad_through_transforms"]


def compiled(fn):
    """``fn`` compiled once (:func:`fx_passes.kernels.ops.body_compiler.compile_body`: detached
    inputs, one dispatch-key set, no_grad, eager if compiling fails)."""
    # emulate_precision_casts: round the logits to the model dtype where the bodies say
    # so (``.to(dtype)``), as the unfused graph does; without it Inductor keeps FP32 in
    # registers, and the backward's recomputed logits would not match the forward's lse.
    return compile_body(fn, fn, fn.__name__, "lm_head_body_eager", {"emulate_precision_casts": True})


def parse_transforms(transforms: str) -> tuple[tuple[str, float], ...]:
    """``"div:<c>,tanh,mul:<c>"`` (``lm_head_match.LMHead.transforms``) as (op, c) steps.
    (Not cached: Dynamo traces it once per body and warns about a cache wrapper.)"""
    steps = []
    for item in filter(None, transforms.split(",")):
        op, _, const = item.partition(":")
        if op not in ("div", "mul", "tanh") or (op != "tanh") != bool(const):
            raise ValueError(f"chunked_logits: unknown logit transform {item!r} in {transforms!r}")
        steps.append((op, float.fromhex(const) if const else 0.0))
    return tuple(steps)


def _transform(z: torch.Tensor, op: str, c: float) -> torch.Tensor:
    if op == "tanh":
        return torch.tanh(z)
    return z / c if op == "div" else z * c


def _transform_grad(grad: torch.Tensor, out: torch.Tensor, op: str, c: float) -> torch.Tensor:
    """The FP32 gradient through one transform (``tanh``'s from its output)."""
    if op == "tanh":
        return grad * (1 - out * out)
    return grad / c if op == "div" else grad * c


# NOTE [rounding FP32 to the model dtype in a body]
# The ``"fp32_tiles"`` backward multiplies FP32 copies of the operands, so its logits tile
# is FP32 and must be rounded to the model dtype, as the forward's model-precision GEMM
# rounded it (else the gradient's softmax does not match the forward's lse).  ``x.to(bf16)``
# inside a compiled body is that rounding only where Inductor keeps it: its C++ code in
# torch 2.13 does with ``emulate_precision_casts``, in torch 2.11 it does not (it keeps
# FP32, even through a bitcast view), and the gradient came out up to twice stock's max
# error.  ``rounded`` writes the rounding with integer ops on the bits, which no version
# folds away: the same values as ``x.to(dtype)`` (round to nearest, ties to even; fp16's
# subnormals and overflow included), bit for bit (``tests/test_rounding.py``).
_F16_TINY, _F16_MAX = 2.0**-14, 65504.0


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` for an FP32 ``x`` and a 16-bit float ``dtype``, computed on the bits
    (NOTE [rounding FP32 to the model dtype in a body]); ``x.to(dtype)`` otherwise."""
    if x.dtype != torch.float32 or dtype not in (torch.bfloat16, torch.float16):
        return x.to(dtype)
    bits = x.view(torch.int32)
    drop = 16 if dtype == torch.bfloat16 else 13  # the mantissa bits the dtype has not
    half, keep = (1 << (drop - 1)) - 1, -(1 << drop)
    near = ((bits + half + ((bits >> drop) & 1)) & keep).view(torch.float32)
    if dtype == torch.float16:  # below 2**-14 a multiple of 2**-24; above 65504 infinite
        tiny = torch.round(x * 2.0**24) * 2.0**-24
        near = torch.where(x.abs() < _F16_TINY, tiny, near)
        near = torch.where(near.abs() > _F16_MAX, near * float("inf"), near)
    return torch.where(torch.isnan(x), x, near).to(dtype)  # (exact now, whatever Inductor keeps)


def _logits(h, w, b, dtype: torch.dtype, transforms: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The chunk's logits and each transform's output.  The matmul's output is rounded to
    the model dtype, as the unfused graph stores it (``rounded``: an FP32 product of the
    ``"fp32_tiles"`` plan's copies); the transforms run in FP32 on it with
    no rounding between them, as stock Inductor's fused kernel computes them (rounding
    each to bf16, as eager does, would be less accurate than the stock compiled path)."""
    return transformed(rounded(F.linear(h, w, b), dtype), transforms)


def transformed(x: torch.Tensor, transforms: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The model-precision logits ``x`` through the ``transforms`` (in FP32, no rounding
    between them), and each transform's output (``x`` itself when there is none)."""
    outs: list[torch.Tensor] = []
    for op, c in parse_transforms(transforms):
        outs.append(_transform(outs[-1] if outs else x.float(), op, c))
    return (outs[-1] if outs else x), outs


def grad_through_transforms(grad: torch.Tensor, outs: list[torch.Tensor], transforms: str) -> torch.Tensor:
    """The FP32 gradient of the logits from that of the transformed logits (``outs``:
    ``transformed``'s)."""
    for (op, c), out in zip(reversed(parse_transforms(transforms)), reversed(outs)):
        grad = _transform_grad(grad, out, op, c)
    return grad


def forward_chunk(h, w, b, tokens, scale, is_div: bool, want_entropy: bool, transforms: str):
    """(lse, logprob or None, entropy or None, lse's residual) of this chunk's rows: the
    logits are computed in model precision, then reduced as the unfused region reduces
    them (``given.stats_and_residual``)."""
    return stats_and_residual(_logits(h, w, b, h.dtype, transforms)[0], tokens, scale, is_div, want_entropy)


def forward_chunk_logits(h, w, b, tokens, scale, is_div: bool, want_entropy: bool, transforms: str):
    """``forward_chunk``'s results and the chunk's logits in model precision (the graph
    returns them).  Transformed logits are rounded to the model dtype once, as stock
    Inductor stores the returned tensor, and the reductions read those rounded values,
    as stock's loss then reads the stored tensor."""
    x = _logits(h, w, b, h.dtype, transforms)[0].to(h.dtype)
    return (*stats_and_residual(x, tokens, scale, is_div, want_entropy), x)


def backward_block(h, w, b, tokens, saved: RowValues, grads: Cotangents, logit_map: LogitMap, g_x=None):
    """Model-precision gradient of this block's matmul output (through the transforms),
    from the token ids (shifted to the block's columns), the forward's per-row values and
    the ``grads`` flowing into the per-row results.

    ``h``/``w``/``b`` may be FP32 copies of the model-precision operands (see
    ``tiling.backward_plan``'s ``"fp32_tiles"``): the logits are rounded to the map's
    ``dtype`` as the forward's were.
    ``g_x``: the block of the returned logits' gradient (zeros when nothing reads it).  As
    stock Inductor's fused backward does it: the region's gradient is formed in FP32 from
    the returned (rounded) logits, ``g_x`` is added in FP32, the transforms' gradients
    follow in FP32 from their unrounded outputs, and the sum is rounded once.
    """
    dtype = logit_map.dtype
    x, outs = _logits(h, w, b, dtype, logit_map.transforms)
    if g_x is not None:
        x = rounded(x, dtype).float()  # the returned values, in FP32: no rounding of the gradient yet
    grad = grad_of_logits(x, tokens, saved.lse, saved.entropy, grads, logit_map.scale, logit_map.is_div,
                          saved.lse_lo)
    if g_x is not None:
        grad = grad + g_x.float()
    return grad_through_transforms(grad, outs, logit_map.transforms).to(dtype)
