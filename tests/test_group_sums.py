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
from tests.helpers import chunked_counters, ops, rewrite_graphs
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


# ---- a loop over packed sequences (miles' sum_of_sample_mean): the groups are a split's items ----

LENGTHS = [20, 28, 16, 32]  # (B * S rows, packed: one sequence after another)


def packed(tol=BF16, empty=False):
    """The inputs as packed ``[T]`` rows (advantages a token); each sequence's first rows
    masked (its prompt, as miles' loss masks leave it out), one sequence all masked with
    ``empty``."""
    hidden, weight, tokens, old, _, _ = inputs(tol.values[0])
    adv = torch.randn(old.numel(), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(old.numel(), dtype=torch.long)
    start = 0
    for i, n in enumerate(LENGTHS):
        mask[start:start + 4 + 2 * i] = 0
        start += n
    if empty:
        mask[LENGTHS[0]:sum(LENGTHS[:2])] = 0
    return [hidden.flatten(0, 1), weight, tokens.flatten(), old.flatten(), adv, mask]


def packed_loss(hidden, weight, tokens, old, adv, up):
    lp = torch.log_softmax((hidden @ weight.T).to(up), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ratio = (lp - old.to(up)).exp()
    return torch.maximum(-adv.to(up) * ratio, -adv.to(up) * ratio.clamp(1 - 0.2, 1 + 0.28))


def miles_sample_mean(hidden, weight, tokens, old, adv, mask, up=F32):
    """miles' ``sum_of_sample_mean``: each sample's masked mean, summed over the samples."""
    loss = packed_loss(hidden, weight, tokens, old, adv, up)
    return sum([(x_i * m_i).sum() / torch.clamp_min(m_i.sum(), 1)
                for x_i, m_i in zip(loss.split(LENGTHS, dim=0), mask.split(LENGTHS, dim=0))])


def miles_per_token(hidden, weight, tokens, old, adv, mask, up=F32):
    """Its ``calculate_per_token_loss`` branch: the samples' masked sums over all their tokens."""
    loss = packed_loss(hidden, weight, tokens, old, adv, up)
    masks = mask.split(LENGTHS)
    total = sum((x_i * m_i).sum() for x_i, m_i in zip(loss.split(LENGTHS), masks))
    return total / torch.clamp_min(mask.sum(), 1)


def sample_means_scaled(hidden, weight, tokens, old, adv, mask, up=F32):
    """Each sample's plain mean (no mask), scaled and offset, over the sample count."""
    loss = packed_loss(hidden, weight, tokens, old, adv, up)
    return (sum(0.5 * x_i.mean() - 1.0 for x_i in loss.split(LENGTHS)) + 2.0) / len(LENGTHS)


def packed_padding_skipped(c: dict, data) -> bool:
    masked = int((data[-1] == 0).sum())
    return c.get("masked_rows") == 1 and masked - 8 * len(LENGTHS) < c.get("rows_skipped", 0) <= masked


@pytest.mark.parametrize("fn", [miles_sample_mean, miles_per_token], ids=lambda f: f.__name__)
def test_a_loop_over_packed_sequences_taken_and_masked_rows_skipped(fn):
    data = packed()
    c = compare(fn, data, BF16, "two_sweeps")
    assert c.get("gradients_in_forward") == 1 and c.get("per_sequence_sums") == 1, c
    assert packed_padding_skipped(c, data), c


@pytest.mark.parametrize("tol,plan,empty", [(FP16, "two_sweeps", False), (BF16, "gpu", True)],
                         ids=["fp16", "gpu_plan_empty_sample"])
def test_packed_sequences_fp16_gpu_plan_and_an_empty_sample(tol, plan, empty):
    c = compare(miles_sample_mean, packed(tol, empty), tol, plan)
    assert c.get("gradients_in_forward") == 1 and c.get("per_sequence_sums") == 1, c


def test_packed_sample_means_without_a_mask():
    c = compare(sample_means_scaled, packed(), BF16, "two_sweeps")
    assert c.get("gradients_in_forward") == 1 and c.get("per_sequence_sums") == 1, c


def test_a_loop_over_packed_sequences_as_one_sum_in_the_graph():
    """The items' ops are gone: ``(x * mask * cat(1 / clamp_min(m_i.sum(), 1))).sum()``
    (the mask the items were split from, so that its zeros are the rows left out)."""
    data = [x.requires_grad_(i in GRAD) for i, x in enumerate(packed())]
    before, after = rewrite_graphs(miles_sample_mean, *data, lm_head_plan="two_sweeps")
    assert ops(before).count(".split") == 2 and ops(before).endswith("add add add add"), ops(before)
    assert ops(after).count(".split") == 1 and "cat" in ops(after) and ops(after).endswith("lm_head_loss"), \
        ops(after)


def test_symbolic_lengths_leave_the_loop_as_it_is():
    """Lengths passed in under ``dynamic=True`` are symbolic (one graph serves every list):
    the loop is left as it is, its value the user's."""
    def fn(hidden, weight, tokens, old, adv, mask, lengths):
        loss = packed_loss(hidden, weight, tokens, old, adv, F32)
        return sum((x_i * m_i).sum() / torch.clamp_min(m_i.sum(), 1)
                   for x_i, m_i in zip(loss.split(lengths), mask.split(lengths)))

    data = packed()
    compiled = torch.compile(fn, backend="chunked_logits", dynamic=True,
                             options={"lm_head_plan": "two_sweeps", "chunk_budget_mib": 0.03})
    for lengths in (LENGTHS, [32, 16, 40, 8]):
        assert torch.allclose(compiled(*data, list(lengths)), fn(*data, list(lengths)), rtol=1e-5)
    c = chunked_counters()
    assert c.get("rewritten") == 1 and "per_sequence_sums" not in c, c


def test_a_sample_value_read_elsewhere_leaves_the_loop_as_it_is():
    """One sample's mean also returned (a logged metric): the loop stays the user's."""
    def fn(hidden, weight, tokens, old, adv, mask, up=F32):
        loss = packed_loss(hidden, weight, tokens, old, adv, up)
        means = [(x_i * m_i).sum() / torch.clamp_min(m_i.sum(), 1)
                 for x_i, m_i in zip(loss.split(LENGTHS), mask.split(LENGTHS))]
        return sum(means), means[1].detach()

    c = compare(fn, packed(), BF16, "two_sweeps")
    assert "per_sequence_sums" not in c and "pass_failed" not in c, c


# ---- the per-token path (the loss stays in the graph): its masked rows skipped too ----

@pytest.mark.parametrize("fn,packed_rows", [(trl_grpo, False), (verl_seq_mean_token_mean, False),
                                            (miles_sample_mean, True)],
                         ids=["trl_grpo", "verl_seq_mean_token_mean", "miles_sample_mean"])
def test_per_token_path_skips_the_masked_rows_of_per_sequence_losses(fn, packed_rows):
    """``fp32_tiles`` (a loss left in the graph, the lm_head's per-token results read by
    it): the reads' skip graph sees the mask through a sum per sequence (NOTE [values of
    several rows read back by a row]), through a loop over packed sequences once those
    are written as sums over the rows, and the padding rows leave the loop (NOTE
    [per-token rows a mask leaves out])."""
    data = packed() if packed_rows else inputs(torch.bfloat16)
    c = compare(fn, data, BF16, "fp32_tiles")
    assert "gradients_in_forward" not in c and c.get("per_sequence_sums") == (1 if packed_rows else None), c
    assert (packed_padding_skipped if packed_rows else padding_skipped)(c, data), c


def per_row_temperature_grpo(hidden, weight, tokens, old, adv, mask, up=F32):
    """A row-local region (a temperature a row) under TRL's ``"grpo"`` normalisation."""
    z = (hidden.flatten(0, 1) @ weight.T).to(up) / (1.0 + 0.1 * old.reshape(-1, 1).abs())
    lp = torch.log_softmax(z, -1).gather(-1, tokens.reshape(-1, 1)).squeeze(-1).view(old.shape)
    loss = per_token_loss(hidden, weight, tokens, old, adv, up, lp)
    return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


@pytest.mark.parametrize("in_forward", [True, False], ids=["row_local_loss", "row_local_sweeps"])
def test_a_row_local_region_skips_the_masked_rows_either_way(in_forward):
    """The row-local loss (gradients in the forward: the sums per sequence written as sums
    over the rows) and, the loss left in the graph, the sweeps' reads (the sums per
    sequence read as they are): both see the mask."""
    data = inputs(torch.bfloat16)
    c = compare(per_row_temperature_grpo, data, BF16, "two_sweeps", gradients_in_forward=in_forward,
                leave_to_stock=False)
    assert c.get("row_local") == 1 and c.get("per_sequence_sums") == (1 if in_forward else None), c
    assert ("gradients_in_forward" in c) == in_forward and padding_skipped(c, data), c


def test_per_token_path_with_every_row_read_keeps_the_users_graph():
    """The log-probs also leave the graph: every row is read, nothing is skipped, and the
    sums per sequence are the user's again."""
    def returns_logps(hidden, weight, tokens, old, adv, mask, up=F32):
        lp = logps(hidden, weight, tokens, up)
        loss = per_token_loss(hidden, weight, tokens, old, adv, up, lp)
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean(), lp.detach()

    data = [x.requires_grad_(i in GRAD) for i, x in enumerate(inputs(torch.bfloat16))]
    _, after = rewrite_graphs(returns_logps, *data, lm_head_plan="fp32_tiles")
    assert ops(after).count(".mean") == 1 and ".sum .sum .clamp truediv .mean" in ops(after), ops(after)
    c = compare(returns_logps, inputs(torch.bfloat16), BF16, "fp32_tiles")
    assert "per_sequence_sums" not in c and "masked_rows" not in c, c
