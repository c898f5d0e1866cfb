"""Gradients in the forward (issue 22, item 1): when the graph reduces a fused lm_head
region's per-row results to its scalar loss, the chunk loop computes the gradients in the
forward (``gradients_in_forward``); the loss and every gradient stay as accurate as stock's."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from fx_passes.kernels.ops.body_compiler import compiling_with
from fx_passes.testing.gemms import cpu_out_dtype_kernels, full_gemms, recording
from tests.helpers import RowGathers, ops, rewrite_graphs
from tests.numerics import F32, TOLERANCES, assert_no_less_accurate

T, H, V = 96, 64, 1024
EPS = 0.2


def _lp(hidden, weight, tok, up):
    logp = torch.log_softmax((hidden @ weight.T).to(up), -1)
    return logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def pg_mean(hidden, weight, tok, adv, old, mask, up=F32):
    return -(_lp(hidden, weight, tok, up) * adv.to(up)).mean()


def masked_mean(hidden, weight, tok, adv, old, mask, up=F32):
    return (-(_lp(hidden, weight, tok, up) * adv.to(up)) * mask.to(up)).sum() / mask.to(up).sum()


def ppo_clip(hidden, weight, tok, adv, old, mask, up=F32):
    r = torch.exp(_lp(hidden, weight, tok, up) - old.to(up))
    adv = adv.to(up)
    loss = -torch.min(r * adv, torch.clamp(r, 1 - EPS, 1 + EPS) * adv)
    return (loss * mask.to(up)).sum() / mask.to(up).sum().clamp(min=1)


def ce_mean(hidden, weight, tok, adv, old, mask, up=F32):
    labels = torch.where(mask > 0, tok, -100)
    return F.cross_entropy((hidden @ weight.T).to(up), labels, ignore_index=-100)


def pg_entropy_bonus(hidden, weight, tok, adv, old, mask, up=F32):
    z = (hidden @ weight.T).to(up) / 0.7
    logp = torch.log_softmax(z, -1)
    entropy = -(torch.softmax(z, -1) * logp).sum(-1)
    lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    return -(lp * adv.to(up)).mean() - 0.01 * entropy.mean()


def logprobs_returned(hidden, weight, tok, adv, old, mask, up=F32):
    lp = _lp(hidden, weight, tok, up)
    return -(lp * adv.to(up)).mean(), lp  # the log-probs leave the graph: no tail


TAILS = [pg_mean, masked_mean, ppo_clip, ce_mean, pg_entropy_bonus]
GRAD = (0, 1)
EAGER = lambda fn, options: fn  # noqa: E731 - compiler.compiling_with(EAGER): chunk bodies run eagerly
SCALES = (1.0, 3.0, 0.25)  # the losses' incoming gradients the tests give
_stock: dict = {}  # (fn, dtype, dynamic, grad) -> {scale: (FP64 reference, stock Inductor's results)}


def _inputs(dtype, t=T):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(t, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 2 / H**0.5).to(dtype)
    tok = torch.randint(0, V, (t,), generator=g)
    old = torch.randn(t, generator=g) * 0.1 - 7
    mask = (torch.rand(t, generator=g) > 0.2).float()
    return hidden, weight, tok, torch.randn(t, generator=g), old, mask


def _run(fn, inputs, scale=1.0, grad=GRAD):
    """(outputs, gradients of ``inputs[grad]``) with ``scale`` as the loss's incoming gradient."""
    inputs = [x.detach().clone().requires_grad_(i in grad) for i, x in enumerate(inputs)]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    grads = torch.autograd.grad(outs[0], [inputs[i] for i in grad],
                                grad_outputs=torch.tensor(scale, dtype=outs[0].dtype))
    return [o.detach() for o in outs], list(grads)


def _reference(fn, inputs, scale=1.0, grad=GRAD):
    f64 = [x.double() if x.is_floating_point() else x for x in inputs]
    return _run(lambda *a: fn(*a, up=torch.float64), f64, scale, grad)


def _check(fn, dtype, out_rtol, grad_rtol, plan="two_sweeps", scale=1.0, dynamic=False, taken=True,
           compiled_bodies=False, grad=GRAD):
    inputs = _inputs(dtype)
    key = (fn, dtype, dynamic, grad)
    if key not in _stock:  # (stock compiled once, run with every scale)
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="inductor", dynamic=dynamic)
        _stock[key] = {s: (_reference(fn, inputs, s, grad), _run(compiled, inputs, s, grad)) for s in SCALES}
    ref, stock = _stock[key][scale]
    torch._dynamo.reset()
    counters.clear()
    fused = torch.compile(fn, backend="chunked_logits", dynamic=dynamic,
                          options={"lm_head_plan": plan, "chunk_budget_mib": 0.125})
    with cpu_out_dtype_kernels(), (contextlib.nullcontext() if compiled_bodies else compiling_with(EAGER)):
        ours = _run(fused, inputs, scale, grad)
    assert counters["chunked_logits"]["lm_head_fused"] == 1, dict(counters["chunked_logits"])
    assert counters["chunked_logits"]["gradients_in_forward"] == int(taken), dict(counters["chunked_logits"])
    assert_no_less_accurate(ours, stock, ref, dtype, out_rtol, grad_rtol)
    for got, st in zip(ours[0], stock[0]):
        assert got.requires_grad == st.requires_grad


def test_region_and_tail_become_one_call():
    """What does not depend on the region (the advantages' and the mask's conversions, the
    mask's sum) stays in the graph; the lm_head matmul, the log-softmax and every step from
    the log-probs to the loss become one ``lm_head_loss`` call, which returns the loss."""
    inputs = [x.requires_grad_(i in GRAD) for i, x in enumerate(_inputs(torch.bfloat16))]
    before, after = rewrite_graphs(masked_mean, *inputs, lm_head_plan="two_sweeps")
    assert ops(before) == (".T matmul .to log_softmax .unsqueeze .gather .squeeze .to mul neg .to mul "
                           ".sum .to .sum truediv")
    assert ops(after) == ".to .to .to .sum lm_head_loss"


BF16 = TOLERANCES[0].values
FP16 = TOLERANCES[1].values


@pytest.mark.sampled
@pytest.mark.parametrize("fn", TAILS, ids=lambda f: f.__name__)
def test_loss_tails_take_the_gradients_in_the_forward(fn):
    _check(fn, *BF16, "two_sweeps", compiled_bodies=fn is pg_entropy_bonus)


@pytest.mark.parametrize("fn", [pg_entropy_bonus, ce_mean], ids=lambda f: f.__name__)
def test_the_gpu_plan_on_this_cpu(fn):
    _check(fn, *BF16, "gpu", compiled_bodies=fn is pg_entropy_bonus)


def test_the_token_logit_is_read_before_the_gradient_overwrites_it():
    """NOTE [a body that writes over its logits]: the cross-entropy with ignored labels on the
    ``gpu`` plan with its chunk body compiled (torch 2.11's Inductor loaded the token's logit
    after the gradient's stores over the row: the loss 3% off, its gradients right), and the
    body reads no logit by a gather (every op of the bodies seen, run eagerly)."""
    _check(ce_mean, *BF16, "gpu", compiled_bodies=True)
    gathered = []

    def watched(fn, options):
        def run(*args, **kwargs):
            with RowGathers(V, gathered):
                return fn(*args, **kwargs)
        return run
    torch._dynamo.reset()
    counters.clear()
    fused = torch.compile(ce_mean, backend="chunked_logits", options={"lm_head_plan": "gpu"})
    with cpu_out_dtype_kernels(), compiling_with(watched):
        _run(fused, _inputs(torch.bfloat16))
    assert counters["chunked_logits"]["gradients_in_forward"] == 1 and gathered == []


@pytest.mark.sampled
@pytest.mark.parametrize("tol,plan,scale", [(BF16, "two_sweeps", 3.0), (BF16, "two_sweeps", 0.25),
                                            (BF16, "gpu", 3.0), (FP16, "two_sweeps", 1.0),
                                            (FP16, "gpu", 3.0)],
                         ids=["bf16-two_sweeps-grad3", "bf16-two_sweeps-grad0.25", "bf16-gpu-grad3",
                              "fp16-two_sweeps", "fp16-gpu-grad3"])
def test_dtypes_and_an_incoming_gradient_other_than_one(tol, plan, scale):
    _check(ppo_clip, *tol, plan, scale)


@pytest.mark.sampled
@pytest.mark.parametrize("fn,plan,scale", [(masked_mean, "two_sweeps", 1.0), (ce_mean, "gpu", 3.0)],
                         ids=["masked_mean-two_sweeps", "ce_mean-gpu-grad3"])
def test_dynamic_shapes(fn, plan, scale):
    _check(fn, *BF16, plan, scale, dynamic=True)


@pytest.mark.parametrize("plan,scale", [("two_sweeps", 1.0), ("two_sweeps", 3.0), ("gpu", 3.0)])
def test_a_frozen_lm_head_weight_gets_no_gradient(plan, scale):
    """LoRA / a frozen head: only the hidden states' gradient is computed and returned."""
    _check(ppo_clip, *BF16, plan, scale, grad=(0,))


def pg_infinite_term(hidden, weight, tok, adv, old, mask, up=F32):
    """A constant term that is infinite (a logged log-prob of a token a filter removed):
    the loss is -inf, the gradients are finite, as autograd has them."""
    return -(_lp(hidden, weight, tok, up) * adv.to(up)).mean() + torch.log(mask.to(up).min() * 0)


@pytest.mark.parametrize("plan", ["two_sweeps", "gpu"])
def test_an_infinite_constant_term_leaves_the_gradients_finite(plan):
    """The factors ``d loss / d sum`` come from the scalar part's own ops on the values it
    reads whole, not from differences of the loss (``inf - inf`` was NaN)."""
    _check(pg_infinite_term, *BF16, plan)


def test_a_tail_with_another_user_keeps_the_recompute_path():
    _check(logprobs_returned, *BF16, taken=False)


def test_the_option_turns_it_off():
    fn = torch.compile(pg_mean, backend="chunked_logits", options={"gradients_in_forward": False})
    _run(fn, _inputs(torch.bfloat16))
    assert counters["chunked_logits"]["lm_head_fused"] == 1
    assert counters["chunked_logits"]["gradients_in_forward"] == 0


def _step_gemms(fn, backend, **options) -> tuple[float, int]:
    """(full-GEMM equivalents of one training step, gradients_in_forward taken or not)."""
    torch._dynamo.reset()
    counters.clear()
    inputs = _inputs(torch.bfloat16, t=256)
    compiled = torch.compile(fn, backend=backend, **({"options": options} if options else {}))
    _run(compiled, inputs)  # compile outside the recording (the chunk bodies too: Inductor's extern
    with recording() as gemms:  # matmuls are recorded, an eager body's aten.linear below autograd not)
        _run(compiled, inputs)
    return full_gemms(gemms, 256, H, V), counters["chunked_logits"]["gradients_in_forward"]


def test_gemms_per_step():
    gemms, _ = _step_gemms(ce_mean, "inductor")
    assert gemms == pytest.approx(3)  # the control: stock's three
    gemms, taken = _step_gemms(ce_mean, "chunked_logits", lm_head_plan="two_sweeps")
    assert taken == 1 and gemms <= 4 + 1e-9
    with cpu_out_dtype_kernels():
        gemms, taken = _step_gemms(ce_mean, "chunked_logits", lm_head_plan="gpu")
    assert taken == 1 and gemms <= 3 + 1e-9
    gemms, taken = _step_gemms(ce_mean, "chunked_logits", lm_head_plan="two_sweeps",
                               gradients_in_forward=False, skip_masked_rows=False)
    assert taken == 0 and gemms >= 5 - 1e-9  # today's recompute path
    masked, taken = _step_gemms(ce_mean, "chunked_logits", lm_head_plan="two_sweeps",
                                gradients_in_forward=False)
    assert taken == 0 and masked < gemms - 0.5  # its loop leaves the ignored labels' rows out


def test_loop_bodies_compile_once_across_calls():
    # (two_sweeps: the loss in the graph on any CPU; "auto" is fp32_tiles on an AVX2-only one)
    fn = torch.compile(pg_mean, backend="chunked_logits", dynamic=True,
                       options={"lm_head_plan": "two_sweeps"})
    _run(fn, _inputs(torch.bfloat16))  # the outer graph and two bodies: the chunk's stats, tail
    compiled = counters["stats"]["unique_graphs"]  # and logits gradient (one), the backward sweep
    assert compiled == 3 and counters["chunked_logits"]["gradients_in_forward"] == 1
    for t in (T, 77):
        _run(fn, _inputs(torch.bfloat16, t))
    assert counters["stats"]["unique_graphs"] == compiled
