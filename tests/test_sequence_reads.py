"""Per-token results whose readers sum them per sequence and go on from those sums (NOTE
[values of several rows read back by a row] in ``fx_passes/match/loss_tail.py``): GSPO's
sequence-level ratio and verl's policy loss with the metrics it returns.  The loss stays in
the graph (``fp32_tiles``: the per-token path) and the padding rows leave the chunk loop."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from fx_passes.testing.gemms import cpu_out_dtype_kernels
from tests.grpo_losses import GRAD, compare, inputs, logps, padding_skipped
from tests.helpers import chunked_counters
from tests.masked_rows import _pattern
from tests.numerics import F32, TOLERANCES, run

BF16, FP16 = TOLERANCES


def _seq_mean(x, mask):
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def trl_gspo(hidden, weight, tokens, old, adv, mask, up=F32):
    """TRL ``GRPOTrainer`` with ``importance_sampling_level="sequence"`` (GSPO, ``beta=0``)
    and its ``"grpo"`` normalisation: the ratio is the ``exp`` of a sequence's mean log-ratio."""
    log_ratio = logps(hidden, weight, tokens, up) - old.to(up)
    coef_1 = torch.exp(_seq_mean(log_ratio, mask).unsqueeze(-1))
    coef_2 = torch.clamp(coef_1, 1 - 3e-4, 1 + 4e-4)
    a = adv.to(up).unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * a, coef_2 * a)
    return _seq_mean(per_token_loss, mask).mean()


def openrlhf_gspo(hidden, weight, tokens, old, adv, mask, up=F32):
    """OpenRLHF's ``PolicyLoss`` with ``policy_loss_type="gspo"``: the sequence's ratio times
    the mask, then its ``masked_mean`` per sequence (NumPy's ``axis=``)."""
    log_ratio = logps(hidden, weight, tokens, up) - old.to(up)
    ratio = ((log_ratio * mask).sum(axis=-1) / mask.sum(axis=-1)).exp().unsqueeze(-1) * mask
    a = adv.to(up).unsqueeze(1)
    loss = -torch.min(ratio * a, ratio.clamp(1 - 0.2, 1 + 0.28) * a)
    return ((loss * mask).sum(axis=-1) / mask.sum(axis=-1)).mean()


def _masked_mean(x, mask):
    return (x * mask).sum() / (mask.sum() + 1e-8)


def verl_vanilla_with_metrics(hidden, weight, tokens, old, adv, mask, up=F32):
    """verl's ``compute_policy_loss_vanilla`` (dual clip left out), returning its loss and,
    detached, its clip fraction and approximate KL, as the actor logs them."""
    neg_kl = torch.clamp(logps(hidden, weight, tokens, up) - old.to(up), min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    a = adv.to(up).unsqueeze(1)
    pg_losses1, pg_losses2 = -a * ratio, -a * torch.clamp(ratio, 0.8, 1.28)
    clipfrac = _masked_mean(torch.gt(pg_losses2, pg_losses1).float(), mask)
    loss = _masked_mean(torch.maximum(pg_losses1, pg_losses2), mask)
    return loss, clipfrac.detach(), _masked_mean(-neg_kl, mask).detach()


def verl_gspo(hidden, weight, tokens, old, adv, mask, up=F32):
    """verl's ``compute_policy_loss_gspo``: the sequence's ratio read back by each token
    through a straight-through ``lp - lp.detach()``, clamped at 10 before the ``exp``."""
    lp = logps(hidden, weight, tokens, up)
    seq = _seq_mean(lp - old.to(up), mask)
    ratio = torch.exp(torch.clamp(lp - lp.detach() + seq.detach().unsqueeze(-1), max=10.0))
    a = adv.to(up).unsqueeze(1)
    pg_losses = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - 3e-4, 1 + 4e-4))
    return _seq_mean(pg_losses, mask).mean()


def _patterns(fn, data) -> tuple[list, list, dict]:
    """The NaN / inf pattern of ``fn``'s loss and gradients, ours and stock's, and our counters."""
    torch._dynamo.reset()
    stock = run(torch.compile(fn, backend="inductor"), data, GRAD)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="chunked_logits",
                             options={"lm_head_plan": "fp32_tiles", "chunk_budget_mib": 0.03})
    with cpu_out_dtype_kernels():
        ours = run(compiled, data, GRAD)
    return _pattern(ours), _pattern(stock), chunked_counters()


@pytest.mark.parametrize("fn", [trl_gspo, openrlhf_gspo], ids=lambda f: f.__name__)
def test_gspo_sequence_ratio_skips_the_padding(fn):
    """Before: every row ran ("sum makes (4,), not one value per row of the region")."""
    data = inputs(torch.bfloat16)
    c = compare(fn, data, BF16, "fp32_tiles")
    assert padding_skipped(c, data), c


def test_verl_policy_loss_with_its_metrics_skips_the_padding():
    """Before: every row ran (the metrics' ``detach``, and the clip fraction's comparison,
    had no rule)."""
    data = inputs(torch.bfloat16)
    c = compare(verl_vanilla_with_metrics, data, BF16, "fp32_tiles")
    assert padding_skipped(c, data), c


def test_gspo_fp16_and_dynamic_shapes():
    data = inputs(torch.float16)
    c = compare(trl_gspo, data, FP16, "fp32_tiles", dynamic=True)
    assert padding_skipped(c, data), c


def test_verl_gspo_skips_the_padding():
    """verl's GSPO reads the sequence's value back through ``lp - lp.detach() + seq.detach()``
    clamped at 10: nothing bounds it, but on a padding row it is the same value in stock's
    program and in the rewritten one, and so is all that follows (NOTE [the same value in
    both programs]).  Before: every row ran ("a value of several rows that no bound holds")."""
    data = inputs(torch.bfloat16)
    c = compare(verl_gspo, data, BF16, "fp32_tiles")
    assert padding_skipped(c, data), c


@pytest.mark.parametrize("fn", [trl_gspo, verl_gspo], ids=lambda f: f.__name__)
def test_a_sequence_value_that_is_not_finite_gives_stocks_nans(fn):
    """A NaN old log-prob on a padding row makes its sequence's ratio NaN (``NaN * 0``) in
    stock's program: the rewritten one, which skips that row, gives the same NaNs, in the
    loss and in every gradient (verl's: ``0 * exp(NaN)``, a padding row's NaN cotangent)."""
    data = inputs(torch.bfloat16)
    data[3][1, -1] = float("nan")
    ours, stock, c = _patterns(fn, data)
    assert padding_skipped(c, data), c
    assert ours == stock and stock[0] == (1, 0, 0), (ours, c)


def test_a_row_local_region_under_gspo_skips_the_padding():
    """A temperature a row (a row-local region, its sweeps' reads): the same reads."""
    def fn(hidden, weight, tokens, old, adv, mask, up=F32):
        z = (hidden.flatten(0, 1) @ weight.T).to(up) / (1.0 + 0.1 * old.reshape(-1, 1).abs())
        lp = torch.log_softmax(z, -1).gather(-1, tokens.reshape(-1, 1)).squeeze(-1).view(old.shape)
        coef_1 = torch.exp(_seq_mean(lp - old.to(up), mask).unsqueeze(-1))
        a = adv.to(up).unsqueeze(1)
        return _seq_mean(-torch.min(coef_1 * a, torch.clamp(coef_1, 1 - 3e-4, 1 + 4e-4) * a), mask).mean()

    data = inputs(torch.bfloat16)
    c = compare(fn, data, BF16, "two_sweeps", leave_to_stock=False)
    assert c.get("row_local") == 1 and padding_skipped(c, data), c


def test_a_row_that_would_give_a_sequence_value_a_nan_gradient_is_not_left_out():
    """A masked row's ``where`` branch times a sequence's value: the row's cotangent there
    is 0, but ``0 * exp(..)``, inf on the masked rows in stock's program, makes that
    value's gradient NaN for the whole sequence.  Leaving the row out (its log-prob read as
    a value of the interval, whose ``exp`` is finite) would give the sequence's other rows
    finite gradients: the row runs (``tail_facts._Interpreter._passes_back_zero``)."""
    def fn(hidden, weight, tokens, old, adv, mask, up=F32):
        lp = logps(hidden, weight, tokens, up)
        seq = (lp * mask).sum(-1, keepdim=True)
        return torch.where(mask > 0, torch.exp(lp.detach() * old) * seq, 0.0).sum()

    data = inputs(torch.bfloat16)
    data[3] = torch.where(data[5] > 0, -1.0, -100.0)  # (exp(-100 lp) overflows on the masked rows)
    ours, stock, c = _patterns(fn, data)
    assert not c.get("rows_skipped") and ours == stock, (ours, stock, c)
