"""Rows that count in a row-local region whose per-row results the graph keeps (issue 36:
a distillation KL returned per token, two losses of one region): a mask that leaves some
rows' results unread leaves those rows out of ``row_local_sweeps_masked``'s loop, GEMMs
included, forward and backward (``match/body_mask.skip_rows_of_region_reads``, NOTE
[row-local rows a mask leaves unread]); every output and gradient as accurate as stock's,
stock's NaN / inf pattern kept."""

import pytest
import torch
from torch._dynamo.utils import counters

from fx_passes import compat
from fx_passes.kernels.ops.body_compiler import compiling_with
from fx_passes.testing.gemms import full_gemms, recording
from tests.masked_rows import BF16, EAGER, FP16, every_row_said
from tests.numerics import assert_no_less_accurate
from tests.rows_row_local_programs import (
    PER_TOKEN,
    H,
    T,
    V,
    forward_and_reverse_kl,
    inputs,
    kd_and_every_kl,
    kd_and_kl_where,
    kd_and_masked_kl,
    kd_and_masked_top_logprobs,
    poisoned,
)


def _run(fn, xs, scale=1.0):
    leaves = [x.detach().clone().requires_grad_(i < 2) for i, x in enumerate(xs)]
    outs = fn(*leaves)
    loss = sum(o for o in outs if o.requires_grad)
    grads = torch.autograd.grad(loss, leaves[:2], grad_outputs=torch.tensor(scale, dtype=loss.dtype))
    return [o.detach() for o in outs], list(grads)


def _reference(fn, xs, scale=1.0):
    return _run(lambda *a: fn(*a, up=torch.float64), [x.double() if x.is_floating_point() else x for x in xs],
                scale)


def _ours(fn, xs, dynamic=False, scale=1.0, **options):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="chunked_logits", dynamic=dynamic,
                             options={"chunk_budget_mib": 0.125, **options})
    with compiling_with(EAGER):
        return _run(compiled, xs, scale), dict(counters["chunked_logits"])


def _check(fn, dtype, tol, masked, dynamic=False, scale=1.0):
    xs = inputs(dtype, masked)
    stock = _run(torch.compile(fn, backend="inductor", dynamic=dynamic), xs, scale)
    ours, c = _ours(fn, xs, dynamic, scale)
    assert c.get("row_local_lm_head") == 1 and c.get("masked_rows") == 1, c
    assert "gradients_in_forward" not in c, c  # (the results are kept: no loss tail joins the body)
    assert_no_less_accurate(ours, stock, _reference(fn, xs, scale), dtype, *tol)
    return c


def _pattern(out):
    return [(int(t.isnan().sum()), int(t.isposinf().sum()), int(t.isneginf().sum()))
            for t in (*out[0], *out[1])]


@pytest.mark.sampled
@pytest.mark.parametrize("masked", [0.0, 0.5, 0.75])
@pytest.mark.parametrize("fn", PER_TOKEN, ids=lambda f: f.__name__)
def test_masked_per_row_results_skip_rows_and_match_stock(fn, masked):
    c = _check(fn, torch.bfloat16, BF16, masked)
    out = round(32 * masked) * T // 32
    # (kept rows rounded up to a multiple of 8: chunks stay aligned)
    assert out - 8 < c.get("rows_skipped", 0) <= out and c.get("rows_seen") == T, c


@pytest.mark.parametrize("dynamic", [False, True])
def test_fp16_dynamic_shapes_and_an_incoming_gradient(dynamic):
    assert _check(kd_and_masked_kl, torch.float16, FP16, 0.5, dynamic, scale=0.3).get("rows_skipped", 0) > 0


@pytest.mark.parametrize("scale", [float("inf"), float("nan")])
def test_a_non_finite_incoming_gradient_gives_stock_nans(scale):
    """A skipped row's cotangent is then ``inf * 0``: NaN; the backward runs every row, so
    the gradients' NaN pattern is the body's own, as stock's."""
    xs = inputs(torch.bfloat16, 0.5)
    stock = _pattern(_run(torch.compile(kd_and_masked_kl, backend="inductor"), xs, scale))
    ours, c = _ours(kd_and_masked_kl, xs, scale=scale)
    assert c.get("rows_skipped", 0) > 0 and _pattern(ours) == stock, (_pattern(ours), stock, c)


KINDS = ["teacher+inf, a masked row", "teacher nan, a masked row", "h+inf, a masked row", "h nan, a kept row",
         "every row masked", "no row masked"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fn", [kd_and_masked_kl, kd_and_kl_where], ids=lambda f: f.__name__)
def test_non_finite_values_as_stock(fn, kind):
    """(NaN, +inf, -inf) counts of every output and both gradients equal stock Inductor's;
    a masked row holding a non-finite value is computed."""
    xs = poisoned(kind)
    stock = _pattern(_run(torch.compile(fn, backend="inductor"), xs))
    ours, c = _ours(fn, xs)
    assert _pattern(ours) == stock, (_pattern(ours), stock, c)
    if "a masked row" in kind:
        assert c.get("rows_skipped", 0) < T // 2, c


def test_results_read_on_every_row_run_every_row_and_say_why():
    from fx_passes.reporting.session import session
    xs = inputs(torch.bfloat16, 0.5)
    stock = _run(torch.compile(kd_and_every_kl, backend="inductor"), xs)
    session.reset()
    ours, c = _ours(kd_and_every_kl, xs)
    assert c.get("row_local_lm_head") == 1 and "masked_rows" not in c and "rows_skipped" not in c, c
    assert_no_less_accurate(ours, stock, _reference(kd_and_every_kl, xs), torch.bfloat16, *BF16)
    said = every_row_said()
    assert c.get("masked_rows_not_skipped") == 1 and len(said) == 1 and "for every row" in said[0], said


def test_the_option_turns_it_off():
    _, c = _ours(kd_and_masked_kl, inputs(torch.bfloat16, 0.5), skip_masked_rows=False)
    assert c.get("row_local_lm_head") == 1 and "masked_rows" not in c and "rows_skipped" not in c, c
    assert "masked_rows_not_skipped" not in c, c


def test_no_compaction_while_a_cuda_graph_is_captured(monkeypatch):
    """Inside a capture the count cannot be read: every row runs (the same results)."""
    monkeypatch.setattr(compat, "_capturing", lambda kind: True)
    xs = inputs(torch.bfloat16, 0.5)
    ours, c = _ours(kd_and_masked_kl, xs)
    assert c.get("masked_rows") == 1 and c.get("rows_skipped", 0) == 0, c
    stock = _run(torch.compile(kd_and_masked_kl, backend="inductor"), xs)
    assert_no_less_accurate(ours, stock, _reference(kd_and_masked_kl, xs), torch.bfloat16, *BF16)


def _gemms(masked):
    xs = inputs(torch.bfloat16, masked, t=256)
    torch._dynamo.reset()
    compiled = torch.compile(forward_and_reverse_kl, backend="chunked_logits")
    _run(compiled, xs)  # compile outside the recording
    with recording() as gemms:
        _run(compiled, xs)
    return full_gemms(gemms, 256, H, V)


# (make test-full; make test: the same count in test_rows_row_local.py and test_rows_per_token.py)
@pytest.mark.full
def test_half_the_rows_masked_half_the_gemms():
    full, half = _gemms(0.0), _gemms(0.5)
    assert 0 < half <= 0.55 * full, (half, full)


# A region whose call has no masked variant runs every row; with a mask it says why (NOTE
# [why every row runs]), without one it says nothing.

def _said_for(fn, xs, grads=2, **options):
    from fx_passes.reporting.session import session
    session.reset()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="chunked_logits", options={"chunk_budget_mib": 0.125, **options})
    leaves = [x.detach().clone().requires_grad_(i < grads) for i, x in enumerate(xs)]
    with compiling_with(EAGER):
        outs = compiled(*leaves)
        sum(o for o in outs if o.requires_grad).backward()
    return dict(counters["chunked_logits"]), every_row_said()


def test_a_call_that_keeps_its_logits_whole_says_why_it_runs_every_row():
    c, said = _said_for(kd_and_masked_kl, inputs(torch.bfloat16, 0.5), row_local_sweeps=False)
    assert c.get("row_local_lm_head_in_call") == 1 and "rows_skipped" not in c, c
    assert c.get("masked_rows_not_skipped") == 1 and len(said) == 1, (c, said)
    assert "its logits are kept whole" in said[0], said


def test_a_teacher_that_takes_a_gradient_says_why_it_runs_every_row():
    c, said = _said_for(kd_and_masked_kl, inputs(torch.bfloat16, 0.5), grads=3)
    assert c.get("row_local_lm_head") == 1 and "rows_skipped" not in c, c
    assert c.get("masked_rows_not_skipped") == 1 and len(said) == 1, (c, said)
    assert "a row input besides the logits, takes a gradient" in said[0], said


def _given_logits_kl(logits, teacher, labels, mask):
    s = torch.log_softmax(logits.float(), -1)
    t = torch.log_softmax(teacher.float(), -1)
    kl = torch.where(mask > 0, (t.exp() * (t - s)).sum(-1), 0.0)
    return kl.sum() / mask.sum(), kl.detach()


def test_given_logits_with_a_mask_say_nothing():
    """The logits exist whole already: skipping rows would save only the body's work, so
    it is not a near miss (the given-logits paths run every row, docs/design/rows-that-count.md)."""
    h, w, teacher, labels, mask = inputs(torch.bfloat16, 0.5)
    c, said = _said_for(_given_logits_kl, [h @ w.T, teacher, labels, mask], grads=1)
    assert c.get("row_local") == 1 and "masked_rows_not_skipped" not in c and not said, (c, said)


def _unmasked_kl(h, w, teacher, labels, mask):
    kl = _kl_of(h, w, teacher)
    return kl.mean(), kl.detach()


def _kl_of(h, w, teacher):
    s = torch.log_softmax((h @ w.T).float(), -1)
    t = torch.log_softmax(teacher.float(), -1)
    return (t.exp() * (t - s)).sum(-1)


@pytest.mark.parametrize("options", [{"row_local_sweeps": False}, {}], ids=["whole", "sweeps"])
def test_a_region_without_a_mask_says_nothing(options):
    """Token ids are not a mask: nothing to say (an integer row input counts only where
    the loss sums it whole)."""
    c, said = _said_for(_unmasked_kl, inputs(torch.bfloat16, 0.5), **options)
    assert "masked_rows_not_skipped" not in c and not said, (c, said)


def test_with_the_option_off_nothing_is_said():
    c, said = _said_for(kd_and_masked_kl, inputs(torch.bfloat16, 0.5), row_local_sweeps=False,
                        skip_masked_rows=False)
    assert "masked_rows_not_skipped" not in c and not said, (c, said)


def _kd_and_top_logprobs(h, w, teacher, labels, mask):
    """A masked KL, and the top-4 log-probs of each row (``[n, 4]``) for logging."""
    s = torch.log_softmax((h @ w.T).float(), -1)
    t = torch.log_softmax(teacher.float(), -1)
    kl = (t.exp() * (t - s)).sum(-1) * mask
    return kl.sum() / mask.sum(), s.topk(4, -1).values.detach()


def test_results_that_are_not_one_value_a_row_say_why_they_run_every_row():
    c, said = _said_for(_kd_and_top_logprobs, inputs(torch.bfloat16, 0.5))
    assert "rows_skipped" not in c and c.get("masked_rows_not_skipped") == 1, (c, said)
    assert len(said) == 1 and "not one value" in said[0], said


def test_a_row_input_written_after_the_loss_moves_before_the_call():
    """``mask[:, None]``, which the region reads, comes after ``kl.sum()``, which reads its
    result: it moves before the call (``fx/placement.movable_before``; this was declined),
    and the outputs and gradients are as accurate as stock's."""
    xs = inputs(torch.bfloat16, 0.5)
    stock = _run(torch.compile(kd_and_masked_top_logprobs, backend="inductor"), xs)
    ours, c = _ours(kd_and_masked_top_logprobs, xs)
    assert c.get("row_local_lm_head") == 1 and "declined" not in c, c
    assert_no_less_accurate(ours, stock, _reference(kd_and_masked_top_logprobs, xs), torch.bfloat16, *BF16)
