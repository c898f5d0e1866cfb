"""Rows that count on the per-token lm_head path (issue 36): when the fused call keeps its
per-token results (the graph returns more than one loss: metrics, masked log-probs) and a
mask leaves some rows' results unread, the loop leaves those rows out, GEMMs included
(``match/row_mask.skip_rows_of_reads``, NOTE [per-token rows a mask leaves out]); every
output and gradient as accurate as stock's, stock's NaN / inf pattern kept."""

import contextlib

import pytest
import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from fx_passes import compat
from fx_passes.kernels.ops.body_compiler import compiling_with
from fx_passes.testing.gemms import cpu_out_dtype_kernels, full_gemms, recording
from tests.masked_rows import BF16, EAGER, FP16, KINDS, T, _inputs, _pattern, _poisoned, every_row_said
from tests.numerics import assert_no_less_accurate

F32 = torch.float32


def _parts(h, w, tok, up, t=1.0):
    logp = torch.log_softmax((h @ w.T).to(up) / t, -1)
    return logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def grpo_with_metrics(h, w, tok, adv, mask, up=F32):
    """examples/grpo_step.py's loss (old log-probs here: adv - 7) and verl's metrics: the
    masked-mean entropy and the masked log-probs."""
    lp, ent = _parts(h, w, tok, up, 0.7)
    m = mask.to(up)
    r = torch.exp(lp - (adv.to(up) - 7.0))
    pg = -torch.minimum(r * adv.to(up), r.clamp(0.8, 1.2) * adv.to(up))
    loss = ((pg - 1e-3 * ent) * m).sum() / m.sum()
    return loss, (ent.detach() * m).sum() / m.sum(), (lp * m).detach()


def where_returned(h, w, tok, adv, mask, up=F32):
    """A masked mean and the log-probs where the mask holds (0 elsewhere) returned."""
    lp, _ = _parts(h, w, tok, up)
    loss = (-(lp * adv.to(up)) * mask.to(up)).sum() / mask.to(up).sum()
    return loss, torch.where(mask > 0, lp.detach(), 0.0)


def two_losses(h, w, tok, adv, mask, up=F32):
    """Two masked sums leave the graph, each with a gradient."""
    lp, ent = _parts(h, w, tok, up)
    return (-(lp * adv.to(up))).masked_fill(mask == 0, 0.0).sum(), (ent * (mask > 0)).sum()


def logprobs_returned(h, w, tok, adv, mask, up=F32):  # every row's log-prob read: nothing skipped
    lp, _ = _parts(h, w, tok, up)
    return (-(lp * adv.to(up)) * mask.to(up)).sum() / mask.sum(), lp.detach()


def mask_after(h, w, tok, adv, mask, up=F32):
    """The mask computed after the region (its ops move before the call)."""
    lp, _ = _parts(h, w, tok, up)
    m = (adv > -0.5).to(up)
    return (-lp * m).sum(), (lp * m).detach()


def mask_of_results(h, w, tok, adv, mask, up=F32):  # a mask made of the results proves nothing
    lp, _ = _parts(h, w, tok, up)
    m = (lp.detach() > -7).to(up)
    return (-lp * m).sum(), (lp * m).detach()


MASKED = [grpo_with_metrics, where_returned, two_losses]


def _run(fn, inputs, scale=1.0, gen=None):
    leaves = [x.detach().clone().requires_grad_(i < 2) for i, x in enumerate(inputs)]
    outs = fn(*leaves)
    loss = outs[0] if len(outs) == 2 and outs[1].requires_grad is False else sum(o for o in outs
                                                                                 if o.requires_grad)
    grads = torch.autograd.grad(loss, leaves[:2], grad_outputs=torch.tensor(scale, dtype=loss.dtype))
    return [o.detach() for o in outs], list(grads)


def _reference(fn, inputs, scale=1.0):
    return _run(lambda *a: fn(*a, up=torch.float64), [x.double() if x.is_floating_point() else x
                                                       for x in inputs], scale)


def _ours(fn, inputs, dynamic=False, scale=1.0, **options):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="chunked_logits", dynamic=dynamic,
                             options={"chunk_budget_mib": 0.125, **options})
    with compiling_with(EAGER):
        return _run(compiled, inputs, scale), dict(counters["chunked_logits"])


def _check(fn, dtype, tol, masked, dynamic=False, scale=1.0):
    inputs = _inputs(dtype, masked)
    stock = _run(torch.compile(fn, backend="inductor", dynamic=dynamic), inputs, scale)
    ours, c = _ours(fn, inputs, dynamic, scale)
    assert c.get("lm_head_fused") == 1 and c.get("masked_rows") == 1 and "gradients_in_forward" not in c, c
    assert_no_less_accurate(ours, stock, _reference(fn, inputs, scale), dtype, *tol)
    return c


@pytest.mark.sampled(4)
@pytest.mark.parametrize("masked", [0.0, 0.5, 0.75])
@pytest.mark.parametrize("fn", MASKED, ids=lambda f: f.__name__)
def test_masked_per_token_results_skip_rows_and_match_stock(fn, masked):
    c = _check(fn, torch.bfloat16, BF16, masked)
    out = round(32 * masked) * T // 32
    # (kept rows rounded up to a multiple of 8: chunks stay aligned)
    assert out - 8 < c.get("rows_skipped", 0) <= out and c.get("rows_seen") == T, c


@pytest.mark.parametrize("dynamic", [False, True])
def test_fp16_dynamic_shapes_and_an_incoming_gradient(dynamic):
    c = _check(grpo_with_metrics, torch.float16, FP16, 0.5, dynamic, scale=0.3)
    assert c.get("rows_skipped", 0) > 0, c


@pytest.mark.parametrize("scale", [float("inf"), float("nan")])
def test_a_non_finite_incoming_gradient_gives_stock_nans(scale):
    """A skipped row's cotangent is then ``0 * inf``: stock's gradients turn NaN (that row's
    ``grad_hidden``, every weight gradient); ours too, from the backward's fold."""
    inputs = _inputs(torch.bfloat16, 0.5)
    stock = _pattern(_run(torch.compile(two_losses, backend="inductor"), inputs, scale))
    ours, c = _ours(two_losses, inputs, scale=scale)
    assert c.get("rows_skipped", 0) > 0 and _pattern(ours) == stock, (_pattern(ours), stock, c)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fn", [grpo_with_metrics, where_returned], ids=lambda f: f.__name__)
def test_non_finite_values_as_stock(fn, kind):
    """(NaN, +inf, -inf) counts of every output and both gradients equal stock Inductor's."""
    inputs = _poisoned(kind)
    stock = _pattern(_run(torch.compile(fn, backend="inductor"), inputs))
    if fn is where_returned and kind == "w+inf":
        # (stock's NaN count then depends on which logits are -inf: its fused backward and
        # the per-token loop's differ before any row is skipped; none is, as without the option)
        stock = _pattern(_ours(fn, inputs, skip_masked_rows=False)[0])
    ours, c = _ours(fn, inputs)
    assert _pattern(ours) == stock, (_pattern(ours), stock, c)
    if kind in ("h+inf, a masked row", "w+inf"):
        assert c.get("rows_skipped", 0) < T // 2, c  # the row (every row, for w) is computed


@pytest.mark.parametrize("fn", [logprobs_returned, mask_of_results], ids=lambda f: f.__name__)
def test_rows_read_or_an_unproven_mask_run_every_row(fn):
    """Every row runs; where the reads have a mask (not a mask made of the results), the
    rewrite says why."""
    from fx_passes.reporting.session import session
    inputs = _inputs(torch.bfloat16, 0.5)
    stock = _run(torch.compile(fn, backend="inductor"), inputs)
    session.reset()
    ours, c = _ours(fn, inputs)
    assert c.get("lm_head_fused") == 1 and "masked_rows" not in c and "rows_skipped" not in c, c
    assert_no_less_accurate(ours, stock, _reference(fn, inputs), torch.bfloat16, *BF16)
    said = every_row_said()
    if fn is logprobs_returned:
        assert c.get("masked_rows_not_skipped") == 1 and len(said) == 1 and "for every row" in said[0], said
    else:
        assert "masked_rows_not_skipped" not in c and not said, (c, said)


def test_a_mask_computed_after_the_region():
    c = _check(mask_after, torch.bfloat16, BF16, 0.5)
    assert 0 < c.get("rows_skipped", 0) < T, c


def test_the_option_turns_it_off():
    _, c = _ours(grpo_with_metrics, _inputs(torch.bfloat16, 0.5), skip_masked_rows=False)
    assert c.get("lm_head_fused") == 1 and "masked_rows" not in c and "rows_skipped" not in c, c
    assert "masked_rows_not_skipped" not in c, c  # (nothing to say: the user turned it off)


@pytest.mark.parametrize("plan", ["gpu", "blocks"])
def test_the_plans_a_gpu_runs_read_the_count_once_a_step(plan):
    """The plans a GPU runs (``gpu`` here on the test-only CPU kernels of ``mm(...,
    out_dtype=)``) skip the rows, as accurate as stock, with one host read a step: the
    forward's count (the backward reads it from a host tensor: no op, no device sync)."""
    inputs = _inputs(torch.bfloat16, 0.5)
    stock = _run(torch.compile(grpo_with_metrics, backend="inductor"), inputs)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(grpo_with_metrics, backend="chunked_logits",
                             options={"chunk_budget_mib": 0.125, "lm_head_plan": plan})
    with cpu_out_dtype_kernels() if plan == "gpu" else contextlib.nullcontext(), compiling_with(EAGER):
        ours = _run(compiled, inputs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _run(compiled, inputs)
    c = dict(counters["chunked_logits"])
    # (two steps, each leaving out half the rows less the rounding to a multiple of 8)
    assert c.get("masked_rows") == 1 and c.get("rows_seen") == 2 * T and c.get("rows_skipped") > T - 16, c
    assert_no_less_accurate(ours, stock, _reference(grpo_with_metrics, inputs), torch.bfloat16, *BF16)
    reads = [e.name for e in prof.events() if e.name in ("aten::_local_scalar_dense", "aten::equal",
                                                         "aten::is_nonzero")]
    assert reads == ["aten::_local_scalar_dense"], reads


def test_no_compaction_while_a_cuda_graph_is_captured(monkeypatch):
    """Inside a capture the count cannot be read: every row runs (the same results)."""
    monkeypatch.setattr(compat, "_capturing", lambda kind: True)
    inputs = _inputs(torch.bfloat16, 0.5)
    ours, c = _ours(grpo_with_metrics, inputs)
    assert c.get("masked_rows") == 1 and c.get("rows_skipped", 0) == 0, c
    stock = _run(torch.compile(grpo_with_metrics, backend="inductor"), inputs)
    assert_no_less_accurate(ours, stock, _reference(grpo_with_metrics, inputs), torch.bfloat16, *BF16)


def _gemms(masked):
    inputs = _inputs(torch.bfloat16, masked, t=256)
    compiled = torch.compile(grpo_with_metrics, backend="chunked_logits")
    _run(compiled, inputs)  # compile outside the recording
    with recording() as gemms:
        _run(compiled, inputs)
    return full_gemms(gemms, 256, 64, 1024)


def test_half_the_rows_masked_half_the_gemms():
    full, half = _gemms(0.0), _gemms(0.5)
    assert half <= 0.55 * full, (half, full)
