"""Gradients in the forward for a row-local region whose lm_head runs chunk by chunk
(issue 21, WD's time): when the graph reduces the region's per-row results to the scalar
loss it returns, the region's body and the loss's row part become one body whose
cotangents are known in the forward, so the forward's row chunks also compute
``grad_hidden`` and the per-row values, and the backward runs only the vocabulary sweep:
four ``[T, H] x [H, V]`` GEMMs a step instead of five (``kernels/row_local/loss.py``).

Each loss is rewritten so (counter ``gradients_in_forward``) and is no further from FP64
than stock Inductor, static and dynamic, bf16 and fp16, for an incoming gradient of one,
a power of two or neither; neither direction allocates a ``[T, V]`` tensor; a loss the
tail rule does not take keeps the five-GEMM call, and so does the option off.  The GPU
plan (``grad_weight`` summed over the row chunks by FP32-output GEMMs: three GEMMs) runs
here on the test-only CPU kernels of ``mm(..., out_dtype=)``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.utils import counters
from torch.fx import symbolic_trace

from fx_passes.kernels.ops import user_bodies
from fx_passes.kernels.ops.body_compiler import compiling_with
from fx_passes.kernels.row_local import split as row_split
from fx_passes.kernels.row_local.loss import _row_local_loss, _row_local_loss_backward, row_bytes
from fx_passes.kernels.row_local.sweeps import row_local_sweeps_backward
from fx_passes.reporting.session import session
from fx_passes.testing.gemms import cpu_out_dtype_kernels, full_gemms, recording
from tests import row_local_cases as rl
from tests import sweep_cases as sweeps
from tests.helpers import assert_retained_backward_repeats, chunked_counters
from tests.numerics import F32, assert_no_less_accurate, dtype_matrix, run

T, V, H = sweeps.T, sweeps.V, sweeps.H
EAGER = sweeps.EAGER
NEEDS = [True, True, False]  # (gradients of the hidden states and the weight; no bias)


@pytest.mark.sampled(3)
@pytest.mark.parametrize("name", list(sweeps.SPLIT))
def test_each_loss_computes_its_gradients_in_the_forward(name):
    """Every loss of the chunked call's suite ends in a mean, a masked mean, a
    ``batchmean`` (its row count read from the hidden states) or a cross-entropy's mean
    over kept labels: each takes the gradients in the forward."""
    fn, inputs, grad_pos = sweeps.case(name)
    c = rl.check(fn, inputs, grad_pos, torch.bfloat16, 2e-6, 2**-8)
    assert c.get("row_local_lm_head") == 1 and c.get("gradients_in_forward") == 1, c


def _run(fn, inputs, grad_pos, scale, up=F32):
    inputs = [t.detach().clone().requires_grad_(i in grad_pos) for i, t in enumerate(inputs)]
    out = fn(*inputs, up=up) if up is not F32 else fn(*inputs)
    grads = torch.autograd.grad(out, [inputs[i] for i in grad_pos], torch.tensor(scale, dtype=out.dtype))
    return [out.detach()], list(grads)


@pytest.mark.sampled
@pytest.mark.parametrize("scale", [3.0, 0.25, -0.3])
@pytest.mark.parametrize("name", ["forward_kl", "smoothed_ce"])
def test_an_incoming_gradient_other_than_one(name, scale):
    """A power of two scales the forward's ``grad_hidden`` exactly; anything else (a
    gradient-accumulation ``loss * 0.3``) recomputes both gradients from the scaled
    cotangents: either way as accurate as stock."""
    _compare(name, scale)


# Every incoming gradient the tests below give a case: stock's one compile of a case runs them all.
SCALES = (3.0, 0.25, -0.3, -1.0, 0.3)


@functools.cache
def _reference_and_stock(name):
    """{scale: (FP64 reference, stock Inductor's run)} of a case, for every scale in ``SCALES``."""
    fn, inputs, grad_pos = sweeps.case(name)
    f64 = [t.double() if t.is_floating_point() else t for t in inputs]
    torch._dynamo.reset()
    stock = torch.compile(fn, backend="inductor")
    return {scale: (_run(fn, f64, grad_pos, scale, up=torch.float64), _run(stock, inputs, grad_pos, scale))
            for scale in SCALES}


def _compare(name, scale, mean_ratio=1.1, **options):
    fn, inputs, grad_pos = sweeps.case(name)
    ref, stock = _reference_and_stock(name)[scale]
    torch._dynamo.reset()
    counters.clear()
    ours = _run(torch.compile(fn, backend="chunked_logits", options=options), inputs, grad_pos, scale)
    assert chunked_counters().get("gradients_in_forward") == 1, chunked_counters()
    assert_no_less_accurate(ours, stock, ref, torch.bfloat16, 2e-6, 2**-8, mean_ratio)


# (g, the mean error ours may have over stock's).  For g not a power of two the two round
# the logits' gradient at different scales (ours for the unit loss, then times g; stock
# g times it): one rounding each, but where g puts the values within their binades moves
# the mean error: over 16 seeds smoothed CE up to 1.15 times stock's, the KLs 1.11
# (``python -m tests.gradient_scaling``, docs/gpu.md "Host syncs")
GPU_SCALES = [(-1.0, 1.1), (0.3, 1.2)]


@pytest.mark.parametrize("scale,mean_ratio", GPU_SCALES)
@pytest.mark.parametrize("name", ["forward_kl", "kl_div_linear", "smoothed_ce"])
def test_the_gpu_plan_on_this_cpu(name, scale, mean_ratio):
    """``lm_head_plan="gpu"`` (CUDA / XPU; here with the test-only CPU kernels of
    ``mm(..., out_dtype=)``): ``grad_weight`` and the bias's gradient summed over the row
    chunks in FP32 in the forward, every gradient scaled by the incoming gradient on the
    device (no host read) and rounded once in the backward, whatever it is."""
    with cpu_out_dtype_kernels():
        _compare(name, scale, mean_ratio, lm_head_plan="gpu")


def test_the_gpu_plan_runs_three_gemms_with_model_precision_inputs():
    """The profiler's GEMMs (the test kernels' own FP32 matmuls inside them left out):
    three, for an incoming gradient of -1 or 0.3; the recorded ``out_dtype`` GEMMs (``g @ W``
    and ``grad_weight``'s sums) have bf16 inputs, none FP32."""
    assert _gemms("kl_div_linear", lm_head_plan="gpu") == pytest.approx(3)
    assert _gemms("kl_div_linear", 0.3, lm_head_plan="gpu") == pytest.approx(3)  # (any g: no recompute)
    fn, inputs, grad_pos = sweeps.case("kl_div_linear")
    with cpu_out_dtype_kernels(), recording() as gemms:
        run(torch.compile(fn, backend="chunked_logits", options={"lm_head_plan": "gpu"}), inputs, grad_pos)
    assert full_gemms(gemms, T, H, V, in_dtype=torch.bfloat16) >= 2
    assert full_gemms(gemms, T, H, V, in_dtype=torch.float32) == 0


@pytest.mark.sampled
@pytest.mark.parametrize("name,dtype,out_rtol,grad_rtol",
                         dtype_matrix(["reverse_kl", "kl_div_linear", "per_token_kl"]))
def test_dynamic_shapes_and_dtypes(name, dtype, out_rtol, grad_rtol):
    fn, inputs, grad_pos = sweeps.case(name, dtype)
    c = rl.check(fn, inputs, grad_pos, dtype, out_rtol, grad_rtol, dynamic=True)
    assert c.get("gradients_in_forward") == 1, c


def test_a_frozen_weight():
    fn, inputs, _ = sweeps.case("forward_kl")
    c = rl.check(fn, inputs, (0,), torch.bfloat16, 2e-6, 2**-8)
    assert c.get("gradients_in_forward") == 1, c


def test_a_teacher_that_needs_a_gradient_keeps_the_backward_sweeps():
    """Only the lm_head's gradients are computed in the forward: logits given that need
    a gradient too (a teacher trained jointly) keep the five-GEMM call."""
    fn, inputs, _ = sweeps.case("reverse_kl")
    c = rl.check(fn, inputs, (0, 1, 2), torch.bfloat16, 2e-6, 2**-8)
    assert c.get("row_local_lm_head") == 1 and not c.get("gradients_in_forward"), c


def test_results_the_graph_returns_keep_the_backward_sweeps():
    hidden, weight = sweeps.head()
    teacher = rl.distinct_logits(T, V, torch.bfloat16, seed=2)

    def kl_and_rows(h, w, teacher, up=F32):
        s = torch.log_softmax((h @ w.T).to(up), -1)
        t = torch.log_softmax(teacher.to(up), -1)
        rows = (t.exp() * (t - s)).sum(-1)
        return rows.mean(), rows
    c = rl.check(kl_and_rows, (hidden, weight, teacher), (0, 1), torch.bfloat16, 2e-6, 2**-8)
    assert c.get("row_local_lm_head") == 1 and not c.get("gradients_in_forward"), c


def test_an_infinite_constant_term():
    """A logged term that is -inf (a reference log-prob of a filtered token) added to the
    loss: the loss is -inf and the gradients are the distillation's, as autograd has them
    (the factor of each sum is not a difference of losses)."""
    hidden, weight = sweeps.head()
    teacher = rl.distinct_logits(T, V, torch.bfloat16, seed=2)
    floor = torch.tensor(float("-inf"))

    def kl_plus(h, w, teacher, floor, up=F32):
        return rl.reverse_kl(h @ w.T, teacher, up) + floor.to(up)
    c = rl.check(kl_plus, (hidden, weight, teacher, floor), (0, 1), torch.bfloat16, 2e-6, 2**-8)
    assert c.get("gradients_in_forward") == 1, c


def test_an_affine_mix_of_two_sums():
    """Two reductions of the per-row KL combined by ``rsub``, ``*``, ``-`` and a division
    by a value read whole: each sum's factor (-3 and ``-1 / w.sum()``) is derived from
    these ops at rewrite time."""
    hidden, weight = sweeps.head()
    teacher = rl.distinct_logits(T, V, torch.bfloat16, seed=2)
    w = torch.rand(T, generator=torch.Generator().manual_seed(3))

    def mix(h, wt, teacher, w, up=F32):
        w = w.to(up)
        s = torch.log_softmax((h @ wt.T).to(up), -1)
        t = torch.log_softmax(teacher.to(up), -1)
        rows = (t.exp() * (t - s)).sum(-1)
        return torch.rsub(rows.mean(), 1.0) * 3.0 - (rows * w).sum() / w.sum()
    c = rl.check(mix, (hidden, weight, teacher, w), (0, 1), torch.bfloat16, 2e-6, 2**-8)
    assert c.get("gradients_in_forward") == 1, c


def test_the_log_says_so_and_the_option_turns_it_off():
    fn, inputs, grad_pos = sweeps.case("forward_kl")
    n_events = len(session.events)
    rl.check(fn, inputs, grad_pos, torch.bfloat16, 2e-6, 2**-8)
    said = [e.what for e in session.events[n_events:] if e.kind == "rewritten"]
    assert any("gradients in the forward through its loss tail (mean)" in s for s in said), said
    c = rl.check(fn, inputs, grad_pos, torch.bfloat16, 2e-6, 2**-8, gradients_in_forward=False)
    assert c.get("row_local_lm_head") == 1 and not c.get("gradients_in_forward"), c


def test_a_retained_graphs_second_backward_equals_the_first():
    fn, inputs, _ = sweeps.case("smoothed_ce")
    h, w = inputs[0].clone().requires_grad_(), inputs[1].clone().requires_grad_()
    torch._dynamo.reset()
    counters.clear()
    # A fresh compile: a backward served warm from AOTAutograd's cache (these graphs are
    # cacheable) is loaded with donated buffers, which torch refuses under retain_graph.
    with torch._functorch.config.patch(enable_autograd_cache=False):
        loss = torch.compile(fn, backend="chunked_logits")(h, w, *inputs[2:])
        assert chunked_counters().get("gradients_in_forward") == 1
        assert_retained_backward_repeats(loss, h, w)


@pytest.mark.parametrize("name", ["forward_kl", "kl_div_linear"])
def test_four_gemms_with_model_precision_inputs(name):
    """Profiler-recorded: the forward's row chunks (logits, ``g @ W``), the backward's
    vocabulary blocks (logits, ``g.T @ h``): four ``[T, H] x [H, V]`` GEMMs, where the
    call without the loss computes five (test_row_local_sweeps)."""
    assert _gemms(name) == 4
    assert _gemms(name, gradients_in_forward=False) == 5


def _gemms(name, scale=None, **options) -> float:
    """Full ``[T, H] x [H, V]`` GEMMs of a profiled step (incoming gradient ``scale``:
    ``numerics.run``'s -1 when None)."""
    from torch.profiler import profile

    fn, inputs, grad_pos = sweeps.case(name)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="chunked_logits", options=options)
    step = run if scale is None else lambda *a: _run(*a, scale)
    with cpu_out_dtype_kernels():
        step(compiled, inputs, grad_pos)
        with profile(record_shapes=True) as prof:
            step(compiled, inputs, grad_pos)
    taken = options.get("gradients_in_forward", True)
    assert chunked_counters().get("gradients_in_forward", 0) == int(taken), chunked_counters()
    names = ("aten::mm", "aten::addmm")
    gemms = [e for e in prof.events()
             if e.name in names and not (e.cpu_parent and e.cpu_parent.name in names)]  # (test kernels' own)
    shapes = [e.input_shapes[1:3] if e.name == "aten::addmm" else e.input_shapes[:2] for e in gemms]
    return sum(2 * a[0] * a[1] * b[1] for a, b in shapes) / (2 * T * H * V)


def _final_mean(m):
    return m, torch.ones((), dtype=torch.float64)  # (the loss, d loss / d mean)


def _inputs():
    hidden, weight = sweeps.head()
    teacher = rl.distinct_logits(T, V, torch.bfloat16, seed=2)
    key = user_bodies.register(symbolic_trace(sweeps.kl_rows))
    return hidden, weight, teacher, key


def _ops(inputs, budget, g, done=True):
    """The op's forward and backward, eagerly, on the distillation body (its loss: the
    mean of the per-row KL); ``done``: what the forward says of its split."""
    hidden, weight, teacher, key = inputs
    final = user_bodies.register(symbolic_trace(_final_mean))
    split = row_split.split_of(key, [0], [0], 0, [hidden.new_empty(0, V), teacher], [], with_outputs=True)
    width = row_bytes(split)
    loss, gh, packed, ok, gw, gb, kept, count = _row_local_loss._init_fn(
        key, [teacher], [], budget, 0, hidden, weight, None, "matmul", final, "mean:float32", 0, width,
        "two_sweeps", NEEDS, "")  # (no skip graph: every row)
    assert int(ok) == 1 and int(count) == T
    ok = ok if done else torch.zeros_like(ok)
    grads = _row_local_loss_backward._init_fn(torch.tensor(g), key, [teacher], [], budget, 0, hidden, weight,
                                              None, "matmul", final, "mean:float32", 0, gh, packed, ok, gw,
                                              gb, kept, count, "two_sweeps", NEEDS)
    return loss, grads


def test_neither_the_logits_nor_their_gradient_exist_whole():
    """The forward and the backward (their ops run eagerly under a dispatch mode)
    allocate no float tensor of ``T x V`` elements and multiply bf16 inputs only; the
    gradients agree with the five-GEMM call's for the same cotangents."""
    budget = 8 * V * 16
    hidden, weight, teacher, key = inputs = _inputs()
    with compiling_with(EAGER):
        with sweeps.Wide() as seen:
            loss, (gh, gw) = _ops(inputs, budget, 1.0)
        want = row_local_sweeps_backward._init_fn(key, [], [0], [teacher], [], [torch.full((T,), 1.0 / T)],
                                                   budget, 0, hidden, weight, None, "matmul", NEEDS)
    assert seen.shapes == [] and seen.gemm_inputs == {torch.bfloat16}, (seen.shapes, seen.gemm_inputs)
    rows = sweeps.kl_rows(hidden @ weight.T, teacher)[0]
    torch.testing.assert_close(loss, rows.mean(), rtol=1e-5, atol=1e-6)
    for got, w in zip((gh, gw), want):  # (a few bf16 units of the largest: roundings of g may differ)
        assert (got.float() - w.float()).abs().max() <= 2**-6 * w.float().abs().max()


@pytest.mark.parametrize("g,done", [(0.3, True), (1.0, False)], ids=["scaled-by-0.3", "not-split"])
def test_the_backward_falls_back_to_both_sweeps(g, done):
    """A gradient that does not scale the forward's ``grad_hidden`` exactly, or a forward
    that did not split, takes both sweeps from the scaled cotangents: the five-GEMM
    call's backward, bit for bit."""
    budget = 8 * V * 16
    hidden, weight, teacher, key = inputs = _inputs()
    with compiling_with(EAGER):
        _, got = _ops(inputs, budget, g, done)
        cot = (torch.tensor(1.0) / T * torch.tensor(g)).expand(T).contiguous()
        want = row_local_sweeps_backward._init_fn(key, [], [0], [teacher], [], [cot], budget, 0, hidden,
                                                   weight, None, "matmul", NEEDS)
    assert len(got) == len(want) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))
