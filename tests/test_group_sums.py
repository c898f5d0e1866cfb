"""Sums per sequence in a loss tail (NOTE [per-sequence sums] in
``fx_passes/rewrite/group_sums.py``): TRL's ``"grpo"`` loss and verl's
``"seq-mean-token-mean"`` / ``"seq-mean-token-sum"`` normalise each sequence on its own
before averaging the sequences.  Before, the loss tail was declined (a sum per sequence is
not a sum over the rows); now the loss is written as one sum over the rows, taken into
the chunk loop, and its masked rows are skipped; where the tail is declined for another
reason, the graph is the user's."""

from __future__ import annotations

import pytest
import torch

from tests.grpo_losses import GRAD, compare, inputs, logps, padding_skipped, per_token_loss
from tests.helpers import ops, rewrite_graphs
from tests.numerics import F32, TOLERANCES

BF16, FP16 = TOLERANCES


def trl_grpo(hidden, weight, tokens, old, adv, mask, up=F32):
    loss = per_token_loss(hidden, weight, tokens, old, adv, up)
    return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def verl_seq_mean_token_mean(hidden, weight, tokens, old, adv, mask, up=F32):
    """verl's ``agg_loss``: each sequence's token mean, averaged over the sequences that
    have a token (a masked mean with ``(seq_mask > 0)``)."""
    loss = per_token_loss(hidden, weight, tokens, old, adv, up)
    seq_mask = torch.sum(mask, dim=-1)
    seq_losses = torch.sum(loss * mask, dim=-1) / (seq_mask + 1e-8)
    seq_mask = (seq_mask > 0).to(up)
    return (seq_losses * seq_mask).sum() / (seq_mask.sum() + 1e-8)


def verl_seq_mean_token_sum(hidden, weight, tokens, old, adv, mask, up=F32):
    loss = per_token_loss(hidden, weight, tokens, old, adv, up)
    return torch.mean(torch.sum(loss * mask, dim=-1))


def offset_and_token_mean(hidden, weight, tokens, old, adv, mask, up=F32):
    """A mean per sequence (``x.mean(-1)``), an offset per sequence and a constant: the
    chain's ``a`` and ``d`` both."""
    per = (-logps(hidden, weight, tokens, up) * mask).mean(-1)
    return (2.0 - (per * 0.5 + adv.to(up)) + 1.0).sum()


LOSSES = [trl_grpo, verl_seq_mean_token_mean, verl_seq_mean_token_sum, offset_and_token_mean]

SUBTRACTIONS = {"minus_number": lambda per, adv: per - 1.0, "minus_tensor": lambda per, adv: per - adv,
                "torch_sub": lambda per, adv: torch.sub(per, adv),
                "rsub": lambda per, adv: torch.rsub(per, 2.0), "number_minus": lambda per, adv: 2.0 - per,
                "tensor_minus": lambda per, adv: adv - per}


@pytest.mark.parametrize("spelling", SUBTRACTIONS)
def test_each_subtraction_in_the_chain_keeps_its_sign(spelling):
    """Was a bug: ``per_sequence - c`` was rewritten as ``+ c`` (a silently wrong loss)."""
    def fn(hidden, weight, tokens, old, adv, mask, up=F32):
        per = (-logps(hidden, weight, tokens, up) * mask).mean(-1)
        return SUBTRACTIONS[spelling](per, adv.to(up)).sum()

    c = compare(fn, inputs(torch.bfloat16), BF16, "two_sweeps")
    assert c.get("gradients_in_forward") == 1 and c.get("per_sequence_sums") == 1, c


@pytest.mark.parametrize("fn", LOSSES, ids=lambda f: f.__name__)
def test_per_sequence_losses_taken_and_padding_skipped(fn):
    data = inputs(torch.bfloat16)
    c = compare(fn, data, BF16, "two_sweeps")
    assert c.get("gradients_in_forward") == 1 and c.get("per_sequence_sums") == 1, c
    assert padding_skipped(c, data), c


CASES = [(FP16, "two_sweeps", False, False), (BF16, "gpu", False, False), (BF16, "two_sweeps", True, False),
         (BF16, "two_sweeps", False, True)]


@pytest.mark.parametrize("fn", [verl_seq_mean_token_sum, offset_and_token_mean], ids=lambda f: f.__name__)
def test_a_symbolic_count_of_sequences_read_off_the_hidden_states(fn):
    """Under ``dynamic=True`` a mean over the sequences, or a constant added per sequence,
    needs their count: where no operand of the chain has one value a sequence, it is read
    off the hidden states' dims."""
    data = inputs(torch.bfloat16)
    c = compare(fn, data, BF16, "two_sweeps", dynamic=True)
    assert c.get("gradients_in_forward") == 1 and c.get("per_sequence_sums") == 1, c


@pytest.mark.parametrize("tol,plan,dynamic,empty", CASES,
                         ids=["fp16", "gpu_plan", "dynamic", "empty_sequence"])
def test_dtypes_plans_dynamic_shapes_and_an_empty_sequence(tol, plan, dynamic, empty):
    """fp16, the ``gpu`` plan, symbolic sizes (the group count read off ``mask.sum(-1)``),
    and a sequence with no token (verl's ``seq_mask > 0`` leaves it out; stock's value)."""
    data = inputs(tol.values[0], empty_sequence=empty)
    c = compare(verl_seq_mean_token_mean if empty else trl_grpo, data, tol, plan, dynamic)
    assert c.get("gradients_in_forward") == 1 and c.get("per_sequence_sums") == 1, c
    assert padding_skipped(c, data), c


def test_the_graph_sums_over_the_rows():
    """``((x * m).sum(-1) / c).mean()`` becomes ``(x * m * (1 / c)[:, None]).sum() / B``
    before the tail is taken into the call: the user's per-sequence ops are gone."""
    data = [x.requires_grad_(i in GRAD) for i, x in enumerate(inputs(torch.bfloat16))]
    before, after = rewrite_graphs(trl_grpo, *data, lm_head_plan="two_sweeps")
    assert ops(before).endswith(".sum .sum .clamp truediv .mean"), ops(before)
    assert ops(after).endswith(".sum .clamp truediv .unsqueeze .expand lm_head_loss"), ops(after)


def test_a_tail_declined_for_another_reason_keeps_the_users_graph():
    """The log-probs also leave the graph: the tail is declined after the rewrite of its
    sums, which is undone (the graph's ops are the user's, stock's numerics)."""
    def returns_logps(hidden, weight, tokens, old, adv, mask, up=F32):
        lp = logps(hidden, weight, tokens, up)
        loss = per_token_loss(hidden, weight, tokens, old, adv, up, lp)
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean(), lp.detach()

    data = inputs(torch.bfloat16)
    _, plain = rewrite_graphs(returns_logps, *[x.requires_grad_(i in GRAD) for i, x in enumerate(data)],
                              lm_head_plan="two_sweeps", gradients_in_forward=False)
    _, after = rewrite_graphs(returns_logps, *data, lm_head_plan="two_sweeps")
    assert ops(after) == ops(plain) and ops(after).count(".mean") == 1, ops(after)
    c = compare(returns_logps, inputs(torch.bfloat16), BF16, "two_sweeps")
    assert "gradients_in_forward" not in c and "per_sequence_sums" not in c, c


def topk_grpo(hidden, weight, tokens, old, adv, mask, up=F32):
    """A row-local region (a top-k filter, the rows flattened) under TRL's ``"grpo"``
    normalisation: its tail (``rewrite_row_loss_tail``) takes the sums per sequence too."""
    z = (hidden.flatten(0, 1) @ weight.T).to(up) / 0.7
    z = z.masked_fill(z < z.topk(50, -1).values[..., -1:], float("-inf"))
    lp = torch.log_softmax(z, -1).gather(-1, tokens.reshape(-1, 1)).squeeze(-1).view(old.shape)
    loss = per_token_loss(hidden, weight, tokens, old, adv, up, lp)
    return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def test_a_row_local_region_takes_them_too():
    data = inputs(torch.bfloat16)
    data[2] = (data[0].float() @ data[1].float().T).argmax(-1)  # (tokens the filter keeps)
    c = compare(topk_grpo, data, BF16, "two_sweeps")
    assert {k: c.get(k) for k in ("row_local", "gradients_in_forward", "per_sequence_sums")} == \
        {"row_local": 1, "gradients_in_forward": 1, "per_sequence_sums": 1}, c
