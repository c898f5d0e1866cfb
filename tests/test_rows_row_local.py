"""Rows that count in the row-local engine (issue 36): with a row-local loss in the graph
(a distillation KL, a cross-entropy of mixed logits), ``row_local_loss`` runs only the rows
whose value and gradient the mask (in the body, in the tail, ``ignore_index``) makes
exactly zero, GEMMs included, forward and backward (``match/body_mask.py``); every result
as accurate as stock's, stock's NaN / inf pattern kept (a row that might make one, a
teacher's inf included, is computed)."""

import functools

import pytest
import torch
from torch._dynamo.utils import counters
from torch.profiler import profile

from fx_passes.testing.gemms import cpu_out_dtype_kernels
from tests.masked_rows import BF16, FP16, StockOnce, every_row_said
from tests.masked_rows import compile_ours as _compile_ours
from tests.masked_rows import ours as _ours
from tests.masked_rows import reference as _reference
from tests.masked_rows import run as _run
from tests.masked_rows import run_ours as _run_ours
from tests.numerics import assert_no_less_accurate
from tests.rows_row_local_programs import (
    MASKED,
    UNPROVEN,
    H,
    T,
    V,
    ensemble_ce,
    inputs,
    kd_and_logprob,
    kd_masked_mean,
    kd_where,
    poisoned,
    reverse_kl_by_hand,
    sft_and_kd,
    smoothed_ce_zloss,
    weighted_ce,
)

SHARES = (0.0, 0.5, 0.75, 1.0)  # the shares of masked rows the tests run (values only: one program)
_reference_and_stock = StockOnce(inputs, SHARES)  # (FP64 reference, stock): once per fn, dtype, ...


def _check(fn, dtype, tol, masked, plan="two_sweeps", dynamic=False, scale=1.0):
    xs = inputs(dtype, masked)
    ref, stock = _reference_and_stock(fn, dtype, masked, dynamic, scale)
    ours, c = _ours(fn, xs, plan, dynamic, scale)
    assert c.get("row_local_lm_head") == 1 and c.get("gradients_in_forward") == 1, c
    assert c.get("masked_rows") == 1, c
    assert_no_less_accurate(ours, stock, ref, dtype, *tol)
    return c


def _pattern(out):
    return [(int(t.isnan().sum()), int(t.isposinf().sum()), int(t.isneginf().sum()))
            for t in (*out[0], *out[1])]


@pytest.mark.sampled(6)
@pytest.mark.parametrize("plan", ["two_sweeps", "gpu"])
@pytest.mark.parametrize("fn", MASKED, ids=lambda f: f.__name__)
def test_masked_row_local_losses_skip_rows_and_match_stock(fn, plan):
    c = _check(fn, torch.bfloat16, BF16, 0.5, plan)
    assert T // 2 - 8 < c.get("rows_skipped", 0) <= T // 2 and c.get("rows_seen") == T, c


@pytest.mark.parametrize("masked", [0.0, 0.75, 1.0])
def test_no_some_or_every_row_masked(masked):
    c = _check(kd_masked_mean if masked < 1 else kd_where, torch.bfloat16, BF16, masked)
    out = round(32 * masked) * T // 32
    assert out - 8 < c.get("rows_skipped", 0) <= out, c  # (kept rows rounded up to a multiple of 8)


@pytest.mark.parametrize("dynamic", [pytest.param(False, marks=pytest.mark.full), True])  # (static: full)
def test_fp16_dynamic_shapes_and_an_incoming_gradient(dynamic):
    """0.3 recomputes both gradients from the scaled cotangents (over the kept rows); -2
    scales the forward's exactly; the ``gpu`` plan scales its FP32 sums on the device."""
    assert _check(kd_masked_mean, torch.float16, FP16, 0.5, "two_sweeps", dynamic, scale=0.3)["rows_skipped"]
    assert _check(kd_where, torch.bfloat16, BF16, 0.5, "two_sweeps", dynamic, scale=-2.0)["rows_skipped"]
    assert _check(kd_masked_mean, torch.bfloat16, BF16, 0.5, "gpu", dynamic, scale=0.3)["rows_skipped"]
    # (label smoothing's ``/ V``: the vocabulary's size, read at run time)
    assert _check(smoothed_ce_zloss, torch.bfloat16, BF16, 0.5, "two_sweeps", dynamic)["rows_skipped"]


KINDS = ["teacher+inf, a masked row", "teacher nan, a masked row", "h+inf, a masked row", "h nan, a kept row",
         "w+inf", "teacher -inf, a kept row"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fn", [kd_masked_mean, kd_where, kd_and_logprob, ensemble_ce, reverse_kl_by_hand],
                         ids=lambda f: f.__name__)
def test_non_finite_values_as_stock(fn, kind):
    """(NaN, +inf, -inf) counts of the loss and both gradients equal stock Inductor's:
    ``kl * 0`` is NaN where the teacher's row is not finite, a ``where`` is 0 there; an
    ignored label's row still gets ``0 * exp(lp)``, NaN, from log-softmax's backward."""
    stock, ours, c = _non_finite_runs(fn, _runs_of(fn))[kind, 1.0]
    assert _pattern(ours) == stock, (_pattern(ours), stock, c)
    if kind.startswith(("h+inf", "w+inf")) or (kind.endswith("a masked row") and fn is not kd_where):
        assert c.get("rows_skipped", 0) < T // 2, c  # (that row, every row for w, is computed)
    assert c.get("rows_seen") == T, c


@pytest.mark.parametrize("plan", ["two_sweeps", "gpu"])
def test_a_class_that_weighs_nothing_leaves_its_rows_out(plan):
    """``cross_entropy(weight=)``: a row whose label's class weighs 0 adds nothing to the
    loss (its mean divides by the weights) and gets no gradient: left out with the ignored
    ones."""
    h, w, teacher, labels, mask = inputs(torch.bfloat16, 0.5)
    out = int(((mask == 0) | (labels % 4 == 0)).sum())
    c = _check(weighted_ce, torch.bfloat16, BF16, 0.5, plan)
    assert T // 2 < out - 8 < c.get("rows_skipped", 0) <= out, (out, c)


def _poisoned(kind):
    if not kind.startswith("h+inf, a kept"):
        return poisoned(kind)
    xs = inputs(torch.bfloat16, 0.5)
    row = next(r for r in range(T) if xs[4][r] > 0 and xs[3][r] % 4 == 0)
    xs[0][row, 5] = float("inf")
    return xs


INCOMING_KINDS = ["teacher+inf, a masked row", "h nan, a kept row"]  # (kd_masked_mean's, with 0.3)


def _runs_of(fn) -> tuple:
    """The (kind, incoming gradient) pairs the non-finite tests run ``fn`` on."""
    kinds = CE_KINDS if fn in (weighted_ce, sft_and_kd) else KINDS
    extra = [(k, 0.3) for k in INCOMING_KINDS] if fn is kd_masked_mean else []
    return tuple([(k, 1.0) for k in kinds] + extra)


@functools.cache
def _non_finite_runs(fn, runs) -> dict:
    """{(kind, incoming gradient): (stock's pattern, ours, the counters of that run)} of
    ``runs``: stock and ours each compiled once (a kind or a gradient changes values only:
    the same programs), ours's counters cleared before each run (what the tests read of
    them, the rows, counts at run time)."""
    torch._dynamo.reset()
    stock = torch.compile(fn, backend="inductor")
    patterns = {(k, s): _pattern(_run(stock, _poisoned(k), s)) for k, s in runs}
    ours = _compile_ours(fn)
    out = {}
    for k, s in runs:
        counters.clear()
        out[k, s] = (patterns[k, s], *_run_ours(ours, _poisoned(k), s))
    return out


CE_KINDS = ["h+inf, a kept row of a class that weighs 0", "teacher nan, a masked row", "h+inf, a masked row"]


@pytest.mark.parametrize("kind", CE_KINDS)
@pytest.mark.parametrize("fn", [weighted_ce, sft_and_kd], ids=lambda f: f.__name__)
def test_non_finite_values_in_cross_entropies_as_stock(fn, kind):
    """A class weighing 0 leaves a row out only where its logits are finite (``-0 * inf``
    is NaN in stock's loss); ``nll_loss``'s ignored rows are 0 in the forward, and NaN in
    the gradient where log-softmax's backward multiplies ``exp(lp)`` by 0."""
    stock, ours, c = _non_finite_runs(fn, _runs_of(fn))[kind, 1.0]
    xs = _poisoned(kind)
    assert _pattern(ours) == stock and c.get("rows_seen") == T, (_pattern(ours), stock, c)
    if kind == "h+inf, a masked row" or fn is weighted_ce and kind.startswith("h+inf"):
        # (that row is computed: fewer than the rows that count allow)
        allowed = int(((xs[4] == 0) | ((xs[3] % 4 == 0) if fn is weighted_ce else False)).sum())
        assert 0 < c.get("rows_skipped", 0) < allowed, (allowed, c)


@pytest.mark.parametrize("kind", INCOMING_KINDS)
def test_non_finite_values_with_an_incoming_gradient_as_stock(kind):
    """An incoming gradient of 0.3: the backward's both sweeps run on the kept rows, with
    stock's (NaN, +inf, -inf) counts."""
    stock, ours, c = _non_finite_runs(kd_masked_mean, _runs_of(kd_masked_mean))[kind, 0.3]
    assert _pattern(ours) == stock and c.get("rows_skipped"), (_pattern(ours), stock, c)


def test_an_infinite_incoming_gradient_as_stock():
    """``inf * 0`` at a masked row is NaN in stock's gradients: the backward runs every row then."""
    xs = inputs(torch.bfloat16, 0.5)
    for fn in (kd_masked_mean, kd_where):
        stock = _pattern(_run(torch.compile(fn, backend="inductor"), xs, float("inf")))
        ours, c = _ours(fn, xs, scale=float("inf"))
        assert c.get("rows_skipped") and _pattern(ours) == stock, (_pattern(ours), stock)


@pytest.mark.parametrize("fn", UNPROVEN, ids=lambda f: f.__name__)
def test_what_no_rule_proves_runs_every_row(fn):
    """Every row runs; with the loss in the call (a mask the rules see), the rewrite says
    why: the op with no rule."""
    from fx_passes.reporting.session import session
    xs = inputs(torch.bfloat16, 0.5)
    stock = _run(torch.compile(fn, backend="inductor"), xs)
    session.reset()
    ours, c = _ours(fn, xs)
    assert c.get("row_local_lm_head") == 1 and "masked_rows" not in c and "rows_skipped" not in c, c
    assert_no_less_accurate(ours, stock, _reference(fn, xs), torch.bfloat16, *BF16)
    expected = {"kd_atan": "atan has no rule", "kd_over_a_vector": "a divisor that is not one number a row"}
    said = every_row_said()
    if fn.__name__ in expected:
        assert c.get("masked_rows_not_skipped") == 1 and len(said) == 1, (c, said)
        assert expected[fn.__name__] in said[0], said
    else:  # (a mask made of the student's logits: no loss in the call, nothing to say)
        assert "masked_rows_not_skipped" not in c and not said, (c, said)


def test_the_option_turns_it_off():
    _, c = _ours(kd_masked_mean, inputs(torch.bfloat16, 0.5), skip_masked_rows=False)
    assert c.get("gradients_in_forward") == 1 and "masked_rows" not in c and "rows_skipped" not in c, c


def _gemms(masked, plan, scale=1.0):
    """Full ``[T, H] x [H, V]`` GEMMs of a profiled step (the logits' GEMMs run inside
    compiled chunk bodies: the profiler sees them; the test kernels' own matmuls left out)."""
    t = 256
    xs = inputs(torch.bfloat16, masked, t=t)
    torch._dynamo.reset()
    compiled = torch.compile(kd_masked_mean, backend="chunked_logits", options={"lm_head_plan": plan})
    _run(compiled, xs, scale)  # compile outside the profile
    with profile(record_shapes=True) as prof:
        _run(compiled, xs, scale)
    names = ("aten::mm", "aten::addmm")
    gemms = [e for e in prof.events()
             if e.name in names and not (e.cpu_parent and e.cpu_parent.name in names)]  # (test kernels' own)
    shapes = [e.input_shapes[1:3] if e.name == "aten::addmm" else e.input_shapes[:2] for e in gemms]
    return sum(2 * a[0] * a[1] * b[1] for a, b in shapes) / (2 * t * H * V)


@pytest.mark.parametrize("plan, scale, n_full",
                         [("two_sweeps", 1.0, 4), ("gpu", 1.0, 3), ("two_sweeps", 0.3, 6)])
def test_half_the_rows_masked_half_the_gemms(plan, scale, n_full):
    """The GEMM audit: 50% of the rows masked, at most 0.55x the full-GEMM equivalents of
    the same step with none masked (4 on the CPU plan, 3 on the GPU plan; an incoming
    gradient of 0.3, which the forward's gradients cannot be scaled by exactly: the CPU
    plan's backward runs both sweeps, on the kept rows)."""
    with cpu_out_dtype_kernels():
        full, half = _gemms(0.0, plan, scale), _gemms(0.5, plan, scale)
    assert full == pytest.approx(n_full)
    assert half <= 0.55 * full, (half, full)


def test_one_host_read_a_step():
    """The ``gpu`` plan reads the count of kept rows once a step (the forward), nothing else."""
    compiled = torch.compile(kd_masked_mean, backend="chunked_logits", options={"lm_head_plan": "gpu"})
    xs = inputs(torch.bfloat16, 0.5)
    with cpu_out_dtype_kernels():
        _run(compiled, xs)
        _run(compiled, xs)
        with profile() as prof:
            _run(compiled, xs)
    reads = [e.name for e in prof.events() if e.name in ("aten::_local_scalar_dense", "aten::item",
                                                         "aten::equal", "aten::is_nonzero")]
    assert reads.count("aten::_local_scalar_dense") == 1 and "aten::equal" not in reads, reads


def test_a_teachers_kept_rows_are_gathered_chunk_by_chunk():
    """The kept rows' wide inputs (a teacher's logits) are gathered per row chunk and per
    vocabulary block, never whole: no gather allocates as much as the kept rows' share of
    the teacher (``[T / 2, V]`` bf16 at half the rows masked)."""
    xs = inputs(torch.bfloat16, 0.5)
    compiled = torch.compile(kd_masked_mean, backend="chunked_logits", options={"chunk_budget_mib": 0.125})
    _run(compiled, xs)
    with profile(profile_memory=True) as prof:
        _run(compiled, xs)
    gathers = [e.cpu_memory_usage for e in prof.events() if e.name in ("aten::index", "aten::index_select")]
    assert gathers and max(gathers) < T // 2 * V * 2, sorted(gathers)[-3:]
