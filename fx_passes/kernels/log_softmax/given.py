"""The fused per-row log-softmax statistics that replace a matched region.

Everything here is written in plain torch ops so that AOTAutograd traces it and
Inductor generates the kernels.  The forward reads the model-precision logits,
upcasts each element to FP32 inside the reduction (``x.float() / t`` is pointwise
and Inductor fuses it into the reduction kernels, so no FP32 ``[T, V]`` buffer is
ever allocated) and keeps only per-row results.  The backward is one pointwise
expression that writes the logits gradient in model precision.

Rows are independent: every result of a row depends only on that row, so it does
not depend on how many rows there are, or how they are batched.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..ops.registry import emitted

Scale = Union[float, int, torch.Tensor, torch.SymFloat, torch.SymInt, None]

__all__ = ["row_stats", "RowStats", "stats_of_logits", "stats_and_residual", "grad_of_logits", "softmax_lse",
           "lse_residual", "per_row_inputs"]


def _scaled(x: torch.Tensor, scale: Scale, scale_is_div: bool) -> torch.Tensor:
    """The FP32 scaled logits ``x.float() / t`` (or ``* s``), formed per element."""
    z = x.float()
    if scale is None:
        return z
    return z / scale if scale_is_div else z * scale


def _shift_and_log_sum(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, log s) per row: the row max m and s = sum exp(z - m), the shift that keeps
    exp() from overflowing.  m is not masked, so non-finite rows come out as
    ``torch.log_softmax`` gives them: a row holding +inf, or only -inf, has
    ``z - m`` NaN and so NaN log-probs and entropy; a NaN anywhere makes the row NaN
    (docs/how-it-works.md, "Non-finite values")."""
    m = z.amax(dim=-1, keepdim=True)
    return m.squeeze(-1), (z - m).exp().sum(dim=-1).log()


def _logsumexp(m: torch.Tensor, log_s: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp``'s value from (m, log s): +inf for a row holding +inf (and no
    NaN), -inf for a row of -inf only, NaN for a row holding NaN."""
    return torch.where(m.isinf(), m, m + log_s)


# NOTE [the rounding of lse]
# The forward forms a token's log-prob as ``(z - m) - log s`` (``_log_probs``): at a
# confident row's top token ``z - m`` is 0 and the log-prob, about ``-(1 - p)``, keeps its
# relative accuracy.  A backward that formed ``log p = z - lse`` from the FP32 ``lse`` alone
# lost it: ``lse`` is rounded to half a spacing of its value (1e-6 at logits of 20), as
# much as ``1 - p`` itself in a row whose top token has p = 1 - 1e-6, so that token's
# ``1 - p`` (a log-prob's gradient) and ``log p + H`` (an entropy's) came out several times
# stock's error there (stock's backward reads the log-probs its forward computed), though
# the largest error over the whole gradient stayed stock's.  So each forward also returns
# the residual ``(m - lse) + log s``, exactly what the rounding of ``m + log s`` took away
# (``m`` is the larger term), a per-row FP32 value its backward alone reads: ``log p =
# (z - lse) - residual``, where ``z - lse`` is exact near the top token.  The ops carry it
# last among their results, after the values the graph reads (``lm_head_stats``, its
# ``_logits``, ``_kept`` and ``_masked`` variants; ``lm_head_loss`` keeps it with its
# per-row values for the ``two_sweeps`` backward); ``tests/test_confident_rows.py``.


def lse_residual(m: torch.Tensor, log_s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """What the FP32 ``lse = m + log s`` rounded away, ``(m - lse) + log s`` (exact: the
    error of one rounded sum, ``m`` the larger term), 0 where ``lse`` is not finite: a
    backward that reads it forms ``log p = (z - lse) - residual`` as the forward formed
    ``(z - m) - log s`` (NOTE [the rounding of lse])."""
    return torch.where(lse.isfinite(), (m - lse) + log_s, 0.0)


def softmax_lse(lse: torch.Tensor, log_softmax: bool) -> torch.Tensor:
    """The lse a backward reads.  A region with a log-softmax result (a token log-prob
    or an entropy, ``log_softmax``) reads NaN where ``lse`` is infinite, since
    ``torch.log_softmax`` of such a row is NaN and so is its gradient.  A region whose
    only results are ``logsumexp`` keeps ``lse``: its gradient is NaN at the row's +inf
    elements and 0 elsewhere, as ``torch.logsumexp``'s."""
    return torch.where(lse.isinf(), float("nan"), lse) if log_softmax else lse


def _log_probs(z_picked: torch.Tensor, m: torch.Tensor, log_s: torch.Tensor) -> torch.Tensor:
    """log p = (z - m) - log s, as log_softmax computes it: z - m is exact for the
    row's top tokens, so a confident token's log-prob near 0 keeps its relative accuracy
    (z - lse would lose it to the rounding of lse)."""
    return (z_picked - m) - log_s


def _grad_logits(logp, tokens, entropy, grads, scale: Scale, scale_is_div: bool) -> torch.Tensor:
    """FP32 gradient, w.r.t. the model-precision logits x, of the per-row ``lse``,
    token ``logprob`` and ``entropy`` of ``z = x.float() / t``, from ``logp = z - lse``.

    ``grads``: (g_lse, g_logprob, g_entropy) (``op_args.Cotangents``); one that is None
    means no gradient flows into that result; ``tokens`` and ``entropy`` are None when
    the forward did not compute log-probs / entropy.
    d/dz of each result:  lse: p;  logprob: onehot(token) - p;  entropy: -p (logp + entropy).
    """
    g_lse, g_logprob, g_entropy = grads
    p = logp.exp()
    # p is read once (a second read makes Inductor keep an FP32 [rows, V] copy of it
    # when the gradient is written through a slice's zero padding).
    coeff_p = logp.new_zeros(logp.shape[:-1])  # per-row weight of p
    if g_lse is not None:
        coeff_p = coeff_p + g_lse
    picked = tokens is not None and g_logprob is not None
    if picked:
        coeff_p = coeff_p - g_logprob
    weight = coeff_p.unsqueeze(-1)
    if entropy is not None and g_entropy is not None:
        weight = weight - g_entropy.unsqueeze(-1) * (logp + entropy.unsqueeze(-1))
    grad_z = p * weight
    if picked:
        onehot = torch.arange(logp.shape[-1], device=logp.device) == tokens.unsqueeze(-1)
        grad_z = grad_z + torch.where(onehot, g_logprob.unsqueeze(-1), 0.0)
    if scale is not None:
        grad_z = grad_z / scale if scale_is_div else grad_z * scale
    return grad_z


def stats_of_logits(x: torch.Tensor, tokens: Optional[torch.Tensor], scale: Scale, scale_is_div: bool,
                    want_entropy: bool, picked_in_the_sweep: bool = False):
    """(lse, token logprob or None, entropy or None) per row of ``z = x.float() / t``:
    the maths of every forward (``RowStats`` here, the lm_head loop's chunks).
    ``picked_in_the_sweep``: the token's logit read by the row's reduction sweep (a sum
    with one term) instead of a gather (NOTE [a body that writes over its logits])."""
    return stats_and_residual(x, tokens, scale, scale_is_div, want_entropy, picked_in_the_sweep)[:3]


def stats_and_residual(x: torch.Tensor, tokens: Optional[torch.Tensor], scale: Scale, scale_is_div: bool,
                       want_entropy: bool, picked_in_the_sweep: bool = False):
    """:func:`stats_of_logits` and, fourth, the residual of ``lse`` (:func:`lse_residual`)."""
    z = _scaled(x, scale, scale_is_div)
    m, log_s = _shift_and_log_sum(z)
    logprob = None
    if tokens is not None and picked_in_the_sweep:
        columns = torch.arange(x.shape[-1], device=x.device)
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        picked = torch.where(columns == tokens.unsqueeze(-1), x, zero).sum(-1, dtype=x.dtype)
        logprob = _log_probs(_scaled(picked, scale, scale_is_div), m, log_s)
    elif tokens is not None:
        picked = x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        logprob = _log_probs(_scaled(picked, scale, scale_is_div), m, log_s)
    entropy = None
    if want_entropy:
        logp = _log_probs(z, m.unsqueeze(-1), log_s.unsqueeze(-1))
        entropy = -(logp.exp() * logp).sum(dim=-1)
    lse = _logsumexp(m, log_s)
    return lse, logprob, entropy, lse_residual(m, log_s, lse)


def grad_of_logits(x, tokens, lse, entropy, grads, scale: Scale, scale_is_div: bool,
                   lse_lo: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gradient w.r.t. the model-precision logits ``x``, in ``x``'s dtype, from the
    forward's ``lse`` (and ``entropy``) and the ``grads`` flowing into the per-row results
    (g_lse, g_logprob, g_entropy): the maths of every backward.  ``lse_lo``: what the
    FP32 ``lse`` rounded away (:func:`lse_residual`), where the forward saved it."""
    logp = _scaled(x, scale, scale_is_div) - lse.unsqueeze(-1)
    if lse_lo is not None:
        logp = logp - lse_lo.unsqueeze(-1)
    grad_z = _grad_logits(logp, tokens, entropy, grads, scale, scale_is_div)
    return grad_z.to(x.dtype)


class RowStats(torch.autograd.Function):
    """Per-row ``lse``, token log-prob and entropy of ``x.float() / t``.

    forward(x, tokens, scale, scale_is_div, want_entropy) -> (lse, logprob, entropy)
    ``tokens`` may be None (then ``logprob`` is None); ``entropy`` is None unless
    asked for.  ``tokens`` has ``x``'s shape without the last dim and must hold
    valid class indices (the caller masks ignored rows).
    """

    @staticmethod
    def forward(ctx, x, tokens, scale, scale_is_div, want_entropy):
        lse, logprob, entropy, lse_lo = stats_and_residual(x, tokens, scale, scale_is_div, want_entropy)
        ctx.scale = scale
        ctx.scale_is_div = scale_is_div
        ctx.save_for_backward(x, tokens, lse, entropy, lse_lo)
        return lse, logprob, entropy

    @staticmethod
    def backward(ctx, g_lse, g_logprob, g_entropy):
        x, tokens, lse, entropy, lse_lo = ctx.saved_tensors
        lse = softmax_lse(lse, log_softmax=tokens is not None or entropy is not None)
        grad = grad_of_logits(x, tokens, lse, entropy, (g_lse, g_logprob, g_entropy), ctx.scale,
                              ctx.scale_is_div, lse_lo)
        return grad, None, None, None, None


@emitted()
def row_stats(
    x: torch.Tensor,
    tokens: Optional[torch.Tensor],
    scale: Scale,
    scale_is_div: bool,
    want_entropy: bool,
):
    """Entry point called from rewritten graphs; see :class:`RowStats`."""
    return RowStats.apply(x, tokens, scale, scale_is_div, want_entropy)


def per_row_inputs(tokens: Optional[torch.Tensor], lse: torch.Tensor, entropy: Optional[torch.Tensor],
                   g_lse, g_logprob, g_entropy) -> dict[str, torch.Tensor]:
    """A per-token backward op's per-row arguments: ``tokens`` (zeros where the forward had
    none), the softmax's lse and each incoming gradient (zeros for one that does not flow
    or whose result the forward did not compute)."""
    zeros = lse.new_zeros(lse.shape)
    return {"tokens": tokens if tokens is not None else torch.zeros(lse.shape, dtype=torch.long,
                                                                     device=lse.device),
            "lse": softmax_lse(lse, log_softmax=tokens is not None or entropy is not None),
            "g_lse": g_lse if g_lse is not None else zeros,
            "g_logprob": g_logprob if (g_logprob is not None and tokens is not None) else zeros,
            "g_entropy": g_entropy if (g_entropy is not None and entropy is not None) else zeros}
