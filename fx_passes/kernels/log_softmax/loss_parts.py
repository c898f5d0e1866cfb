"""The parts of a loss loop that ``lm_head_loss`` (:mod:`.loss`) and ``row_local_loss``
(:mod:`fx_passes.kernels.row_local.loss`) share.

The loss tail at run time: ``trace_tail`` (its row part and that part's vector-Jacobian
product, traced once at compile time), the reductions' kinds, the rows' weights for a unit
loss and the loss from the FP64 sums over the chunks (``final_loss``, ``loss_of_sums``).
The gradients: ``add_fp32_grads`` (the ``"gpu"`` plan's row chunk, FP32 outputs of
model-precision GEMMs) and the exact scaling of a gradient computed for a unit loss by the
incoming one (``scaled_exactly`` / ``scale_exactly_``: only where no element rounds).
See NOTE [lm_head_loss plans].
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ... import compat
from ..ops import user_bodies
from ..tiling import even_splits

__all__ = ["trace_tail", "reductions_of", "final_loss", "row_weights", "loss_of_sums", "add_fp32_grads",
           "power_of_two", "scaled_exactly", "scale_exactly_"]

F32 = torch.float32


def trace_tail(key: str, n_ops: int, examples: list[torch.Tensor]) -> str:
    """Register ``(lse, logprob, entropy, *ops, *weights) -> (g_lse, g_logprob, g_entropy,
    *sums)`` for the tail registered under ``key``: its sums over a chunk and the gradient
    of ``sum(weights[k] * sums[k])`` w.r.t. the chunk's results (the vector-Jacobian
    product of the user's ops), traced to ATen ops here, at compile time (``examples``:
    tensors of the inputs' dtypes and ranks): eager functorch does not run inside a custom
    op under AOTAutograd's run-time checks, a traced graph runs anywhere."""
    fn = user_bodies.function(key)

    def tail(lse, logprob, entropy, *rest):
        ops, weights = rest[:n_ops], rest[n_ops:]

        def partial(a, b, c):
            return tuple(fn(a, b, c, *ops))
        outs, pullback = torch.func.vjp(partial, lse, logprob, entropy)
        grads = pullback(tuple(w.to(o.dtype).expand_as(o) for w, o in zip(weights, outs)))
        # (each chunk's sum in FP64, as the loop accumulates them: a model-precision sum
        # rounded per chunk would depend on the chunk count; rounded once, in loss_of_sums)
        return (*grads, *(o.sum(dtype=torch.float64) if o.is_floating_point() else o.sum() for o in outs))
    return user_bodies.register(make_fx(tail, tracing_mode="symbolic")(*examples))


def reductions_of(kinds: str) -> list[tuple[str, torch.dtype]]:
    """``"sum:float32,mean:float32"`` as (kind, dtype) per reduction."""
    return [(k, getattr(torch, d)) for k, d in (item.split(":") for item in kinds.split(","))]


def final_loss(final_key: str, values, whole) -> torch.Tensor:
    """The loss from the reductions' ``values`` (the scalar part's first result)."""
    return user_bodies.function(final_key)(*values, *whole)[0]


def unit_weights(final_key: str, kinds: str, whole, device) -> list[torch.Tensor]:
    """d loss / d reduction_k, in FP32.  The scalar part is affine in the reductions (the
    matcher's rule); its graph returns these factors after the loss, computed in FP64
    from the values it reads whole (``rewrite/tail_graphs.py``: a constant term, even an
    infinite one, plays no part)."""
    at = [torch.zeros((), dtype=dt, device=device) for _, dt in reductions_of(kinds)]
    return [w.to(device=device, dtype=F32) for w in user_bodies.function(final_key)(*at, *whole)[1:]]


def row_weights(final_key: str, kinds: str, whole, n: int, device) -> list[torch.Tensor]:
    """d loss / d result_k[row] for a unit loss: a sum's factor, a mean's over the ``n`` rows."""
    units = unit_weights(final_key, kinds, whole, device)
    return [w / n if kind == "mean" else w for w, (kind, _) in zip(units, reductions_of(kinds))]


def loss_of_sums(final_key: str, kinds: str, sums, n: int, whole) -> torch.Tensor:
    """The loss from each reduction's FP64 sum over all rows (a mean's over ``n``)."""
    values = [(s / n if kind == "mean" else s).to(dt) for s, (kind, dt) in zip(sums, reductions_of(kinds))]
    return final_loss(final_key, values, whole)


def add_fp32_grads(g: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, grad_h: Optional[torch.Tensor],
                   grad_w: Optional[torch.Tensor], grad_b: Optional[torch.Tensor], cols: int) -> None:
    """The ``"gpu"`` plan's row chunk (logits gradient ``g`` of the rows ``h``):
    ``grad_h = g @ weight`` and the FP32 sums over rows ``grad_w += g.T @ h`` (``cols``
    columns a GEMM: an FP32 ``[cols, H]`` product at most), ``grad_b += g.sum(0)``, each
    GEMM with model-precision inputs and an FP32 output (``out_dtype``); None: not wanted."""
    if grad_h is not None:
        torch.mm(g, weight, out_dtype=F32, out=grad_h)
    if grad_w is not None:
        for v0, v1 in even_splits(weight.shape[0], cols):
            compat.addmm_fp32_(grad_w[v0:v1], g[:, v0:v1].t(), h)
    if grad_b is not None:
        grad_b += g.sum(0, dtype=F32)


def power_of_two(scale: float) -> bool:
    """Is ``scale`` +-2**k (1 and -1 included), a factor that rounds no normal number?"""
    return math.isfinite(scale) and abs(math.frexp(scale)[0]) == 0.5


def scaled_exactly(grad: torch.Tensor, scale: float) -> Optional[torch.Tensor]:
    """``grad * scale`` when the product rounds no element (``scale`` a power of two, 1
    and -1 included, and nothing under- or overflows), else None: a gradient computed in
    the forward for a unit loss and rounded there may be used only so."""
    if not power_of_two(scale):
        return None
    out = grad * scale
    return out if abs(scale) == 1.0 or _unrounded(out, grad, scale) else None


def scale_exactly_(grad: torch.Tensor, scale: float) -> bool:
    """``grad *= scale`` in place when the product rounds no element (no copy of the
    whole tensor: a ``[V, H]`` gradient is large); False, ``grad`` unchanged, otherwise."""
    if not power_of_two(scale):
        return False
    if abs(scale) != 1.0 and not _unrounded(grad * scale, grad, scale):
        return False
    if scale != 1.0:
        grad.mul_(scale)
    return True


def _unrounded(out: torch.Tensor, grad: torch.Tensor, scale: float, block: int = 1 << 20) -> bool:
    """``out == grad * scale`` undone exactly by ``/ scale``, checked a block at a time."""
    return all(torch.equal(o / scale, g) for o, g in zip(out.reshape(-1).split(block),
                                                           grad.reshape(-1).split(block)))
