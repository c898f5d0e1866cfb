"""``softmax`` / ``log_softmax`` from saved row statistics, with their own gradients, for a
row-local region's backward (:mod:`fx_passes.rewrite.saved`).

From the max ``m`` and the log-sum (or sum) of exponentials a forward saved, the backward's
values are pointwise and the same bit for bit: ``log_softmax(z) = (z - m) - ls``,
``softmax(z) = exp(z - m) / s``.  See NOTE [saved normalizers].
"""

# NOTE [saved normalizers]
# The forward of a region computes ``log_softmax(z)`` (a max and a sum of exponentials over
# each row, then the pointwise result); its backward, which recomputes the region's values
# to take their vector-Jacobian product, would do those reductions again.  The forward computes
# each as ATen decomposes it, keeping its two reductions (the max ``m`` and the log of the
# sum of exponentials, or the sum), one number a row each; from them the backward's values
# are pointwise and the same bit for bit: ``log_softmax(z) = (z - m) - ls``, ``softmax(z)
# = exp(z - m) / s``.  Written so, autograd would take ``m`` and ``ls`` for constants and
# lose their part of the gradient, so each is an ``autograd.Function`` whose backward is
# the op's own (``g - exp(out) * sum(g)`` for ``log_softmax``, ``out * (g - sum(g * out))``
# for ``softmax``), which ``torch.func.vjp`` and Inductor trace into the backward body's
# fused kernels.

from __future__ import annotations

import torch

from ..ops.registry import emitted

__all__ = ["log_softmax_stats", "softmax_stats", "log_softmax_given", "softmax_given"]


def _setup(ctx, inputs, output):  # (z, a, b, dim): the op's output is what its gradient reads
    ctx.dim = inputs[3]
    ctx.save_for_backward(output)


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(z, m, ls, dim):
        return (z - m) - ls

    setup_context = staticmethod(_setup)

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g - out.exp() * g.sum(ctx.dim, keepdim=True), None, None, None


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(z, m, s, dim):
        return (z - m).exp() / s

    setup_context = staticmethod(_setup)

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return out * (g - (g * out).sum(ctx.dim, keepdim=True)), None, None, None


@emitted()
def log_softmax_stats(z: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log_softmax(z, dim), m, ls)``: ATen's own decomposition (``m`` the max,
    ``ls = log(sum(exp(z - m)))``, the result ``(z - m) - ls``), whose two reductions the
    forward keeps for the backward."""
    m = z.amax(dim, keepdim=True)
    ls = (z - m).exp().sum(dim, keepdim=True).log()
    return (z - m) - ls, m, ls


@emitted()
def softmax_stats(z: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(softmax(z, dim), m, s)``: ATen's decomposition (``m`` the max,
    ``s = sum(exp(z - m))``, the result ``exp(z - m) / s``)."""
    m = z.amax(dim, keepdim=True)
    e = (z - m).exp()
    s = e.sum(dim, keepdim=True)
    return e / s, m, s


@emitted()
def log_softmax_given(z: torch.Tensor, m: torch.Tensor, ls: torch.Tensor, dim: int) -> torch.Tensor:
    """``log_softmax(z, dim)`` from the forward's ``log_softmax_stats``: the same values
    bit for bit, pointwise, with log_softmax's gradient."""
    return _LogSoftmax.apply(z, m, ls, dim)


@emitted()
def softmax_given(z: torch.Tensor, m: torch.Tensor, s: torch.Tensor, dim: int) -> torch.Tensor:
    """``softmax(z, dim)`` from the forward's ``softmax_stats``, with softmax's gradient."""
    return _Softmax.apply(z, m, s, dim)
