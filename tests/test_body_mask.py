"""Soundness of the row-local skip graph's rules (``match/body_mask.py``), one program per
rule, no compile: where the skip graph says a row may be left out, the row's summed
values and its logits' gradient are exactly 0 in eager FP32 (hostile rows included: inf
and NaN logits, a teacher's inf, a class weight of 0 or NaN); and every clean masked row
is left out (a rule that fell back to "unknown" fails)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx import symbolic_trace

from fx_passes.kernels.ops import user_bodies
from fx_passes.match.body_mask import skip_rows_of_body
from tests.zero_rows_entries import ENTRIES

T, V = 64, 32
F64 = torch.float64


def _t(x, teacher, labels, mask, cw):
    return torch.log_softmax(x, -1), torch.log_softmax(teacher.float(), -1)


def kl_masked(x, teacher, labels, mask, cw):
    s, t = _t(x, teacher, labels, mask, cw)
    return ((t.exp() * (t - s)).sum(-1) * mask,)


def kl_column(x, teacher, labels, mask, cw):
    s, t = _t(x, teacher, labels, mask, cw)
    return ((t.exp() * (t - s) * mask[:, None]).sum(-1),)


def mean_amax_amin(x, teacher, labels, mask, cw):
    s = torch.log_softmax(x, -1)
    return ((s.mean(-1) + x.amax(-1) - x.amin(-1)) * mask,)


def logsumexp_pow(x, teacher, labels, mask, cw):
    return (torch.logsumexp(x, -1).pow(2) * mask, torch.square(x.sum(-1) * 0.01) * mask)


def soft_labels(x, teacher, labels, mask, cw):
    p = torch.softmax(teacher.float(), -1)
    return (-(p * torch.log_softmax(x, -1)).sum(-1) * mask,)


def gathered(x, teacher, labels, mask, cw):
    s = torch.log_softmax(x, -1)
    return (torch.where(mask > 0, s.gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1), 0.0),)


def _target(labels, mask):
    return torch.where(mask > 0, labels, -100)


def ce_ignored(x, teacher, labels, mask, cw):
    return (F.cross_entropy(x, _target(labels, mask), reduction="none", ignore_index=-100),)


def ce_weighted(x, teacher, labels, mask, cw):
    return (F.cross_entropy(x, _target(labels, mask), weight=cw, reduction="none"),)


def ce_smoothed(x, teacher, labels, mask, cw):
    return (F.cross_entropy(x, _target(labels, mask), weight=cw, reduction="none", label_smoothing=0.1),)


def nll(x, teacher, labels, mask, cw):
    return (F.nll_loss(torch.log_softmax(x, -1), _target(labels, mask), reduction="none"),)


def nll_weighted(x, teacher, labels, mask, cw):
    return (F.nll_loss(torch.log_softmax(x, -1), _target(labels, mask), cw, reduction="none"),)


def smoothing_by_hand(x, teacher, labels, mask, cw):
    """Label smoothing's term as the rewrite writes it (``/ V`` from the logits' size)."""
    s = torch.log_softmax(x, -1)
    term = (-s.sum(-1) * (0.1 / x.size(-1))).masked_fill(_target(labels, mask) == -100, 0.0)
    return (term, F.nll_loss(s, _target(labels, mask), reduction="none") * 0.9)


def kl_div_log_target(x, teacher, labels, mask, cw):
    s, t = _t(x, teacher, labels, mask, cw)
    return (F.kl_div(s, t, reduction="none", log_target=True).sum(-1) * mask,)


def kl_div_probabilities(x, teacher, labels, mask, cw):
    s, t = _t(x, teacher, labels, mask, cw)
    return (F.kl_div(s, t.exp(), reduction="none").sum(-1) * mask,)


def logsumexp_shift(x, teacher, labels, mask, cw):
    """Log-probs as ``x - logsumexp(x)``: at most 0 whatever the logits' bound."""
    s = x - x.logsumexp(-1, keepdim=True)
    t = torch.log_softmax(teacher.float(), -1)
    return ((s.exp() * (s - t)).sum(-1) * mask,)


def softmax_by_hand(x, teacher, labels, mask, cw):
    """The row's max subtracted, ``exp``, its sum (at least 1), ``log``, a division by it."""
    d = x - torch.max(x, -1, keepdim=True)[0]
    e = d.exp()
    total = e.sum(-1, keepdim=True)
    return ((e / total * (d - total.log())).sum(-1) * mask,)


def log_softmax_by_columns(x, teacher, labels, mask, cw):
    """The max and the log-sum as columns of per-row values (``[:, None]``, ``unsqueeze``)."""
    d = x - x.amax(-1)[:, None]
    s = d - d.exp().sum(-1).log().unsqueeze(-1)
    return (-s.gather(-1, labels[:, None]).squeeze(-1) * mask,)


PROGRAMS = [kl_div_log_target, kl_div_probabilities, kl_masked, kl_column, mean_amax_amin, logsumexp_pow,
            soft_labels, gathered, ce_ignored, ce_weighted, ce_smoothed, nll, nll_weighted, smoothing_by_hand,
            logsumexp_shift, softmax_by_hand, log_softmax_by_columns]
# rows left out besides the masked ones: a label whose class weighs 0 (no label smoothing)
WEIGHS_ZERO = {ce_weighted, nll_weighted}


def _inputs(seed, hostile):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, V, generator=g) * 3
    teacher = (torch.randn(T, V, generator=g) * 3).bfloat16()
    labels = torch.randint(0, V, (T,), generator=g)
    mask = (torch.arange(T) % 2 == 0).float()  # odd rows masked
    cw = (torch.arange(V) % 4 != 0).float()  # a quarter of the classes weigh 0
    if hostile:
        x[1, 3], x[3, 0], x[5, 7] = float("inf"), float("nan"), float("-inf")  # masked rows
        x[4, 1] = float("inf")  # a kept row
        teacher[7, 2], teacher[9, 4] = float("inf"), float("nan")
        teacher[11] = float("-inf")  # a row of -inf: NaN log-probs
    return x, teacher, labels, mask, cw


def _skip(fn, xs):
    """The skip graph of body ``fn(logits, *row inputs, class weights)`` on ``xs`` (the
    mask the fourth row input)."""
    key = user_bodies.register(symbolic_trace(fn))
    specs = [(v.dtype, tuple(v.shape), "cpu") for v in xs]
    n_sums = len(fn(*xs))
    found = skip_rows_of_body(key, 0, tuple(specs[:-1]), tuple(specs[-1:]), n_sums, {3})
    assert found is not None, f"{fn.__name__}: no rule proves a row"
    z = xs[0].double().abs().amax(-1)  # (the logits' bound a row; NaN where one is NaN)
    weights = [torch.ones((), dtype=F64)] * n_sums
    width = torch.full((), float(V), dtype=F64)
    return user_bodies.function(found)(width, z, *xs[1:], *weights).expand(T)


def _check_sound(fn, xs, skip):
    """Where ``skip``: the row's summed values and its logits' gradient exactly 0."""
    x = xs[0].clone().requires_grad_(True)
    outs = fn(x, *xs[1:])
    sum(o.sum() for o in outs).backward()
    for o in outs:
        bad = skip & ~(o.detach() == 0)
        assert not bad.any(), (fn.__name__, bad.nonzero().flatten().tolist())
    bad = skip & ~(x.grad == 0).all(-1)
    assert not bad.any(), (fn.__name__, bad.nonzero().flatten().tolist())


@pytest.mark.parametrize("hostile", [False, True], ids=["clean", "hostile"])
@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_a_row_left_out_is_exactly_zero_in_value_and_gradient(fn, hostile):
    for seed in range(3):
        xs = _inputs(seed, hostile)
        skip = _skip(fn, xs)
        _check_sound(fn, xs, skip)
        # every clean masked row (or ignored / weighing-0 label) is left out
        labels, mask, cw = xs[2], xs[3], xs[4]
        out = mask == 0
        if fn in WEIGHS_ZERO:
            out |= cw[labels] == 0
        clean = torch.isfinite(xs[0]).all(-1) & torch.isfinite(xs[1].float()).all(-1)
        missed = out & clean & ~skip
        assert not missed.any(), (fn.__name__, seed, missed.nonzero().flatten().tolist())


@pytest.mark.parametrize("fn", [ce_weighted, ce_smoothed, nll_weighted], ids=lambda f: f.__name__)
def test_a_class_weight_that_is_not_finite(fn):
    """A NaN class weight: stock's backward multiplies the rows' cotangents by every class
    weight; no row is left out for its label's weight, and what is left out is sound."""
    xs = list(_inputs(0, False))
    xs[4] = xs[4].clone()
    xs[4][1] = float("nan")
    skip = _skip(fn, xs)
    _check_sound(fn, xs, skip)
    assert not (skip & (xs[3] > 0)).any(), fn.__name__


@pytest.mark.parametrize("fn", [logsumexp_shift, softmax_by_hand, log_softmax_by_columns, kl_masked],
                         ids=lambda f: f.__name__)
def test_shifted_logits_at_a_bound_past_exp_s_range(fn):
    """Logits bounded by about 300 a row (real hidden states give bounds in the hundreds):
    ``exp`` of the bound overflows, so only the relations (``x - max(x) <= 0``,
    ``x - logsumexp(x) <= 0``, ``sum(exp(x - max(x))) >= 1``) prove the masked rows; each
    is left out, and soundly, hostile rows included."""
    for hostile in (False, True):
        xs = list(_inputs(0, hostile))
        xs[0] = xs[0] * 30
        skip = _skip(fn, xs)
        _check_sound(fn, xs, skip)
        clean = torch.isfinite(xs[0]).all(-1) & torch.isfinite(xs[1].float()).all(-1)
        missed = (xs[3] == 0) & clean & ~skip
        assert not missed.any(), (fn.__name__, missed.nonzero().flatten().tolist())


def test_every_rule_has_a_program():
    """The reductions over the vocabulary, the losses and the vocabulary's size each have a
    program above."""
    from fx_passes.fx.graph_ops import op_name
    from fx_passes.match.vocab_rules import _NORMALIZE, _REDUCE
    names = {op_name(n) for fn in PROGRAMS for n in symbolic_trace(fn).graph.nodes}
    rules = _REDUCE | _NORMALIZE | {"gather", "cross_entropy", "nll_loss", "kl_div", "size", "pow", "square",
                                    "max", "log", "div"}
    assert rules <= names, rules - names


def _entry(name):
    """ZERO_ROWS entry ``name`` (``tests/zero_rows_entries.py``) on a label's log-prob, in a
    body: ``(logits, advantages, labels, mask, class weights)``."""
    def fn(x, adv, labels, mask, cw):
        lp = torch.log_softmax(x, -1).gather(-1, labels[:, None]).squeeze(-1)
        return (ENTRIES[name](lp, adv, mask > 0, mask),)
    fn.__name__ = name
    return fn


@pytest.mark.parametrize("hostile", [False, True], ids=["clean", "adv+inf, a masked row"])
@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_each_elementwise_entry_in_a_body(name, hostile):
    """``fx/op_rules.ZERO_ROWS``, read through a row-local body: sound, and every clean
    masked row left out."""
    fn = _entry(name)
    x, teacher, labels, mask, cw = _inputs(0, False)
    adv = torch.randn(T, generator=torch.Generator().manual_seed(1))
    if hostile:
        adv[1] = float("inf")
    xs = [x, adv, labels, mask, cw]
    skip = _skip(fn, xs)
    _check_sound(fn, xs, skip)
    missed = (mask == 0) & torch.isfinite(adv) & ~skip
    assert not missed.any(), (name, missed.nonzero().flatten().tolist())


def test_the_bound_sums_rows_in_blocks_as_whole(monkeypatch):
    """``|h|`` summed per row in FP64 by blocks of rows (no FP64 ``[T, H]`` copy) is the
    whole sum, bit for bit, inf and NaN rows included."""
    from fx_passes.kernels import rows
    h = torch.randn(37, 24).bfloat16()
    h[3, 2], h[9, 0] = float("inf"), float("nan")
    monkeypatch.setattr(rows, "_SUM_BLOCK_BYTES", 8 * 24 * 5)  # (blocks of 5 rows)
    torch.testing.assert_close(rows._abs_sums(h), h.abs().sum(-1, dtype=F64), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_skipped_rows_value_lies_in_its_interval(dtype):
    """``rows.inside``: 0 where the interval holds it, else an end rounded into it; where
    no value of the dtype lies in the interval (or an end is NaN), none is offered."""
    from fx_passes.kernels.rows import inside
    lo = torch.tensor([-3.0, 1.0001, -5.0, 2.0, float("nan"), -math.inf, 1.0 + 2**-12], dtype=F64)
    hi = torch.tensor([4.0, 1.0002, -4.99, 2.0, 1.0, 3.0, 1.0 + 2**-11], dtype=F64)
    fill, ok = inside(lo, hi, dtype)
    assert fill.dtype == dtype
    d = fill.double()
    assert bool(((lo <= d) & (d <= hi))[ok].all()) and fill[0] == 0 and ok[3] and fill[3] == 2
    assert not ok[4], "a NaN end"
    assert ok[5] and fill[5] == 0
    # (a float32 1.0001 lies in the narrow interval; bf16 / fp16 have none there)
    assert bool(ok[1]) == (dtype == torch.float32)
