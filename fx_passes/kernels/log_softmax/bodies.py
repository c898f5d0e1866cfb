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
from .given import grad_of_logits, stats_of_logits

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


def _logits(h, w, b, dtype: torch.dtype, transforms: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The chunk's logits and each transform's output.  The matmul's output is rounded to
    the model dtype, as the unfused graph stores it; the transforms run in FP32 on it with
    no rounding between them, as stock Inductor's fused kernel computes them (rounding
    each to bf16, as eager does, would be less accurate than the stock compiled path)."""
    return transformed(F.linear(h, w, b).to(dtype), transforms)


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
    """(lse, logprob or None, entropy or None) of this chunk's rows: the logits are
    computed in model precision, then reduced as the unfused region reduces them."""
    return stats_of_logits(_logits(h, w, b, h.dtype, transforms)[0], tokens, scale, is_div, want_entropy)


def forward_chunk_logits(h, w, b, tokens, scale, is_div: bool, want_entropy: bool, transforms: str):
    """``forward_chunk``'s results and the chunk's logits in model precision (the graph
    returns them).  Transformed logits are rounded to the model dtype once, as stock
    Inductor stores the returned tensor, and the reductions read those rounded values,
    as stock's loss then reads the stored tensor."""
    x = _logits(h, w, b, h.dtype, transforms)[0].to(h.dtype)
    return (*stats_of_logits(x, tokens, scale, is_div, want_entropy), x)


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
        x = x.to(dtype).float()  # the returned values, in FP32: no rounding of the gradient yet
    grad = grad_of_logits(x, tokens, saved.lse, saved.entropy, grads, logit_map.scale, logit_map.is_div)
    if g_x is not None:
        grad = grad + g_x.float()
    return grad_through_transforms(grad, outs, logit_map.transforms).to(dtype)
