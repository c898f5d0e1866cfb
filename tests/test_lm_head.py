"""lm_head inside the chunk: the logits matmul runs per row chunk (forward) and per
vocabulary block (backward), so not even the model-precision logits exist whole."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from fx_passes.kernels.ops.args import Cotangents, Head, HeadOptions, RowValues
from fx_passes.kernels.ops.body_compiler import compiling_with
from fx_passes.testing.gemms import cpu_out_dtype_kernels
from fx_passes.testing.workloads import WORKLOADS, run_step
from tests.cases import lm_logprob_entropy
from tests.codegen import allocations, compiled_codes, step_codes
from tests.helpers import LargestFP32
from tests.numerics import (
    F32,
    TOLERANCES,
    assert_no_less_accurate,
    assert_stock_logits,
    dtype_matrix,
    max_err,
    reference,
    run,
)


def lm_ce_bias_shift(hidden, weight, bias, labels, up=F32):
    # [B, S, H] hidden states, next-token shift, bias, HF-style flatten
    logits = F.linear(hidden[:, :-1], weight, bias)
    return F.cross_entropy(logits.to(up).reshape(-1, weight.shape[0]), labels[:, 1:].reshape(-1),
                           ignore_index=-100)


def lm_tied(ids, weight, labels, up=F32):
    hidden = torch.tanh(F.embedding(ids, weight))  # the same weight embeds and projects
    logits = hidden @ weight.t()
    return F.cross_entropy(logits.to(up), labels, reduction="sum")


def lm_softcap(hidden, weight, tok, adv, up=F32):
    # Gemma2's final_logit_softcapping: tanh(x / c) * c in model precision, then the upcast
    logits = torch.tanh((hidden @ weight.T) / 30.0) * 30.0
    logp = torch.log_softmax(logits.to(up), -1)
    return -(logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1) * adv.to(up)).mean()


def lm_scaled(hidden, weight, labels, up=F32):
    # Cohere's logit_scale (x * c); the trailing / 1.5 is moved after the upcast (a temperature)
    logits = F.linear(hidden, weight) * 0.0625 / 1.5
    return F.cross_entropy(logits.to(up), labels)


# The vocabulary of these tests and a budget that cuts it (and T) as 1 MiB cuts GPT-2's 50257:
# the same numbers of row chunks and vocabulary blocks (remainders included) at a twelfth of
# the elements (the sizes are not what they test; the FP64 reference and each run cost less).
V_TEST = 4099
BUDGET_MIB = V_TEST / 50257


def _inputs(name, dtype, T=61, H=32, V=V_TEST):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    if name == "logprob_entropy":
        h = torch.randn(T, H, generator=g).to(dtype)
        tok = torch.randint(0, V, (T,), generator=g)
        return lm_logprob_entropy, (h, w, tok, torch.randn(T, generator=g)), (0, 1)
    if name == "ce_bias_shift":
        h = torch.randn(3, T, H, generator=g).to(dtype)
        b = (torch.randn(V, generator=g) * 0.1).to(dtype)
        labels = torch.randint(0, V, (3, T), generator=g)
        labels[:, ::5] = -100
        return lm_ce_bias_shift, (h, w, b, labels), (0, 1, 2)
    if name == "softcap":
        h = torch.randn(T, H, generator=g).to(dtype)
        w3 = (w.float() * 10).to(dtype)  # logits up to about +-40: the cap matters
        tok, adv = torch.randint(0, V, (T,), generator=g), torch.randn(T, generator=g)
        return lm_softcap, (h, w3, tok, adv), (0, 1)
    if name == "scaled":
        h = torch.randn(T, H, generator=g).to(dtype)
        return lm_scaled, (h, (w.float() * 16).to(dtype), torch.randint(0, V, (T,), generator=g)), (0, 1)
    if name == "tied":
        ids = torch.randint(0, V, (T,), generator=g)
        return lm_tied, (ids, w, torch.randint(0, V, (T,), generator=g)), (1,)
    raise KeyError(name)


# The backward plans (tiling.backward_plan), each forced on this CPU (lm_head_plan), whatever it would pick;
# "blocks" is the GPU plan.
CPU_PLANS = ["two_sweeps", "fp32_tiles", "blocks"]
# "gpu" (CUDA/XPU) runs here through fx_passes.testing.gemms's CPU kernels for mm.dtype, in
# tests of its own (fewer cases: its loop is the same for every region, and a case costs seconds).
EAGER = lambda fn, options: fn  # noqa: E731 - compiler.compiling_with(EAGER): chunk bodies run eagerly


@functools.cache
def _reference_and_stock(name, dtype, V):
    """(FP64 reference, stock Inductor's run) of a case: the same for every plan (and the
    "gpu" plan's test), so computed once per module."""
    fn, inputs, grad_pos = _inputs(name, dtype, V=V)
    return reference(fn, inputs, grad_pos), run(torch.compile(fn, backend="inductor"), inputs, grad_pos)


@pytest.fixture
def plan(request):
    """The backward plan, forced through the public option (``lm_head_plan``)."""
    return request.param


@pytest.mark.sampled(3)
@pytest.mark.parametrize("name,dtype,out_rtol,grad_rtol,plan",
                         dtype_matrix(["logprob_entropy", "ce_bias_shift", "tied", "softcap", "scaled"],
                                      CPU_PLANS), indirect=["plan"])
def test_lm_head_numerics_no_worse_than_stock(name, dtype, out_rtol, grad_rtol, plan):
    fn, inputs, grad_pos = _inputs(name, dtype)
    (ref_outs, ref_grads), (stock_outs, stock_grads) = _reference_and_stock(name, dtype, V_TEST)
    torch._dynamo.reset()
    counters.clear()
    # a small budget: several row chunks and vocabulary blocks, T not divisible by either
    fused = torch.compile(fn, backend="chunked_logits", options={"chunk_budget_mib": BUDGET_MIB,
                                                                 "lm_head_plan": plan})
    outs, grads = run(fused, inputs, grad_pos)
    assert counters["chunked_logits"]["lm_head_fused"] == 1, dict(counters["chunked_logits"])
    assert_no_less_accurate((outs, grads), (stock_outs, stock_grads), (ref_outs, ref_grads),
                            dtype, out_rtol, grad_rtol)


@pytest.mark.parametrize("name,dtype,out_rtol,grad_rtol", [
    pytest.param("ce_bias_shift", *TOLERANCES[0].values, id="ce_bias_shift-bf16"),
    pytest.param("softcap", *TOLERANCES[1].values, id="softcap-fp16"),
])
@pytest.mark.sampled
def test_gpu_plan_numerics_no_worse_than_stock(name, dtype, out_rtol, grad_rtol):
    """The "gpu" plan (model-precision GEMM inputs, grad_hidden summed across vocabulary
    blocks through out_dtype=float32) on this CPU, through the test-only kernels of
    fx_passes.testing.gemms (a bias, a shift, ignored labels; a softcap in fp16; several
    row groups: tests/test_gemm_audit.py)."""
    fn, inputs, grad_pos = _inputs(name, dtype, V=V_TEST)
    ref, stock = _reference_and_stock(name, dtype, V_TEST)
    torch._dynamo.reset()
    counters.clear()
    fused = torch.compile(fn, backend="chunked_logits",
                          options={"chunk_budget_mib": 1, "lm_head_plan": "gpu"})
    with cpu_out_dtype_kernels():
        ours = run(fused, inputs, grad_pos)
    assert counters["chunked_logits"]["lm_head_fused"] == 1, dict(counters["chunked_logits"])
    assert_no_less_accurate(ours, stock, ref, dtype, out_rtol, grad_rtol)


def test_unknown_logit_transform_keeps_the_matmul_and_says_which(caplog):
    def fn(hidden, weight, labels):
        return F.cross_entropy(torch.sigmoid(hidden @ weight.T).float(), labels)

    h, w = torch.randn(8, 16).bfloat16(), torch.randn(64, 16).bfloat16()
    with caplog.at_level("INFO", logger="fx_passes"):
        torch.compile(fn, backend="chunked_logits")(h, w, torch.randint(0, 64, (8,)))
    assert dict(counters["chunked_logits"]) == {"rewritten": 1, "lm_head_not_fused": 1}
    assert "the logits pass through sigmoid" in caplog.text and "tanh(x)" in caplog.text


def test_no_logits_buffer_at_all():
    w = WORKLOADS["W4"]
    T, V = 256, 4096
    stock = step_codes(w, torch.compile(w.fn, backend="inductor"), w.make(T, V))
    torch._dynamo.reset()
    codes = step_codes(w, torch.compile(w.fn, backend="chunked_logits"), w.make(T, V))
    assert counters["chunked_logits"]["lm_head_fused"] == 1
    logits_sized = [a for c in codes for a in allocations(c) if a[0] == (str(T), str(V))]
    assert logits_sized == [], "not even model-precision logits"
    assert [a for c in stock for a in allocations(c) if a[0] == (str(T), str(V))], "positive control"


# (make test-full; make test: test_returned_logits_dynamic_lengths_one_outer_graph, below)
@pytest.mark.full
def test_dynamic_lengths_compile_the_outer_graph_once():
    w = WORKLOADS["W4"]
    fn = torch.compile(w.fn, backend="chunked_logits", dynamic=True)
    for T in (64, 100, 37):  # warm up: the loop bodies see full and partial chunks
        run_step(w, fn, w.make(T, 512))
    compiled = counters["stats"]["unique_graphs"]
    for T in (71, 90, 45, 128):
        run_step(w, fn, w.make(T, 512))
    assert counters["chunked_logits"]["lm_head_fused"] == 1  # the outer graph compiled once
    assert counters["stats"]["unique_graphs"] == compiled  # and nothing compiles per length


# (make test-full; make test: test_loss_in_graph.py::test_loop_bodies_compile_once_across_calls)
@pytest.mark.full
def test_loop_bodies_compile_once_across_calls_and_grad_modes():
    """Was a gap: the bodies compiled again on the second call (a dispatch-key and a
    requires_grad guard) and at every grad-mode change.  (The recompute path's bodies:
    test_loss_in_graph checks those of gradients in the forward.)"""
    w = WORKLOADS["W4"]
    fn = torch.compile(w.fn, backend="chunked_logits", dynamic=True, options={"gradients_in_forward": False})
    inputs = w.make(64, 512)
    run_step(w, fn, inputs)  # compiles the outer graphs and both bodies
    compiled = counters["stats"]["unique_graphs"]
    assert compiled == 3  # the outer graph, the forward body, the backward body
    for _ in range(2):
        run_step(w, fn, inputs)
    with torch.no_grad():  # scoring: a new outer graph (grad mode), the same forward body
        fn(*inputs)
    assert counters["stats"]["unique_graphs"] == compiled + 1


def _backward_inputs(T, H, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).bfloat16()
    weight = (torch.randn(V, H, generator=g) / H**0.5).bfloat16()
    tokens = torch.randint(0, V, (T,), generator=g)
    lse = torch.logsumexp((hidden.double() @ weight.double().T), -1).float()
    g_rows = torch.randn(3, T, generator=g)
    return hidden, weight, tokens, lse, g_rows


def _grads64(hidden, weight, tokens, g_lse, g_lp):
    """FP64 maths on the model-precision values: (grad_hidden, grad_weight)."""
    x = (hidden.double() @ weight.double().T)
    p = torch.softmax(x, -1)
    onehot = torch.nn.functional.one_hot(tokens, weight.shape[0]).double()
    grad_x = p * (g_lse - g_lp).double()[:, None] + onehot * g_lp.double()[:, None]
    grad_x = grad_x.bfloat16().double()  # the op hands the logits' gradient on in bf16
    return grad_x @ weight.double(), grad_x.T @ hidden.double()


@pytest.mark.parametrize("budget", [2**20, 48 * 2**10])  # one sweep; several (T rows in groups of 96)
def test_backward_has_no_fp32_buffer_of_all_rows(budget):
    """Was a gap (issue 10): grad_hidden was accumulated in an FP32 [T, H] buffer.  Now
    a group of rows at a time is (an FP32 [S, H] buffer, S from the budget), and the
    gradients are the same with one sweep or several."""
    import fx_passes.kernels.log_softmax.lm_head_sweeps as sweeps
    T, H, V = 300, 64, 512
    hidden, weight, tokens, lse, (g_lse, g_lp, g_ent) = _backward_inputs(T, H, V)
    with LargestFP32() as mode, compiling_with(EAGER):  # eager bodies: every op is seen
        gh, gw, _ = sweeps.lm_head_grads(Head(hidden, weight, None, tokens), RowValues(lse),
                                         Cotangents(g_lse, g_lp, g_ent),
                                         HeadOptions(False, False, budget, plan="fp32_tiles"))
    groups = -(-T // sweeps.accumulator_rows(budget, T, H))
    assert (groups == 1) == (budget == 2**20)
    if groups > 1:
        assert mode.largest < T * H, "an FP32 buffer as large as [T, H]"
    # the same gradients as FP64 maths on the model-precision values, to FP32 accuracy
    for got, want in zip((gh, gw), _grads64(hidden, weight, tokens, g_lse, g_lp)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-3 * want.abs().max().item())


class _Matmuls(TorchDispatchMode):
    """(input dtypes, output shape) of every matmul."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            mats = [a for a in args if isinstance(a, torch.Tensor)][-2:]
            self.calls.append(({m.dtype for m in mats}, tuple(out.shape)))
        return out


def test_two_sweeps_model_precision_matmuls_each_a_whole_sum():
    """On a CPU with bf16 units (issue 10): no FP32 matmul and no FP32 buffer of [T, H];
    every matmul writing a gradient covers its whole sum (all V for a row chunk of
    grad_hidden, all T for a block of grad_weight), so each element is rounded once."""
    import fx_passes.kernels.log_softmax.lm_head_sweeps as sweeps
    T, H, V = 300, 64, 512
    budget = 48 * 2**10  # several row chunks and several blocks
    hidden, weight, tokens, lse, (g_lse, g_lp, g_ent) = _backward_inputs(T, H, V)
    with _Matmuls() as mm, LargestFP32() as big, compiling_with(EAGER):
        gh, gw, _ = sweeps.lm_head_grads(Head(hidden, weight, None, tokens), RowValues(lse),
                                         Cotangents(g_lse, g_lp, g_ent),
                                         HeadOptions(False, False, budget, plan="two_sweeps"))
    rows, cols = sweeps.sweep_sizes(budget, T, V)
    assert 1 < rows < T and 1 < cols < V
    assert all(dtypes == {torch.bfloat16} for dtypes, _ in mm.calls), mm.calls
    writes_h = [shape for _, shape in mm.calls if shape[1] == H and shape[0] <= rows]
    writes_w = [shape for _, shape in mm.calls if shape[1] == H and shape[0] > rows]
    assert sum(s[0] for s in writes_h) == T and sum(s[0] for s in writes_w) == V
    assert big.largest < T * H
    for got, want in zip((gh, gw), _grads64(hidden, weight, tokens, g_lse, g_lp)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("plan", CPU_PLANS, indirect=True)
def test_frozen_weight_computes_no_weight_gradient(plan):
    """A frozen lm_head (LoRA, a frozen head): the backward skips grad_weight's matmuls
    (the loops' matmuls are seen by a dispatch mode: fewer, and none whose output is a
    block of grad_weight), and grad_hidden is the same bits as with the weight trainable."""
    fn, inputs, _ = _inputs("logprob_entropy", torch.bfloat16)
    fused = torch.compile(fn, backend="chunked_logits", options={"chunk_budget_mib": BUDGET_MIB,
                                                                 "lm_head_plan": plan})
    run(fused, inputs, (0, 1))  # (compiles the bodies)
    with _Matmuls() as trainable:
        _, (gh_all, _) = run(fused, inputs, (0, 1))
    with _Matmuls() as frozen:
        _, (gh,) = run(fused, inputs, (0,))
    assert torch.equal(gh, gh_all)
    T, H = inputs[0].shape
    weight_blocks = [shape for _, shape in trainable.calls if shape[1] == H and shape[0] != T]
    assert weight_blocks and len(frozen.calls) < len(trainable.calls), (trainable.calls, frozen.calls)
    assert len(frozen.calls) == len(trainable.calls) - len(weight_blocks), (trainable.calls, frozen.calls)


# --- the graph also returns the logits (Hugging Face models do) -------------------------------

def lm_ce_returns_logits(hidden, weight, labels, up=F32):
    # [B, S, H] hidden states; HF's ForCausalLMLoss flattens the upcast logits and returns them too
    logits = F.linear(hidden, weight)
    loss = F.cross_entropy(logits.to(up).reshape(-1, weight.shape[0]), labels.reshape(-1), ignore_index=-100)
    return loss, logits


def lm_softcap_returns_logits(hidden, weight, labels, up=F32):
    # Gemma2: the softcapped logits are returned, and the loss reads them
    logits = torch.tanh(F.linear(hidden, weight) / 30.0) * 30.0
    loss = F.cross_entropy(logits.to(up).reshape(-1, weight.shape[0]), labels.reshape(-1), ignore_index=-100)
    return loss, logits


RETURNS_LOGITS = [lm_ce_returns_logits, lm_softcap_returns_logits]


def _returns_logits_inputs(dtype, B=2, S=37, H=32, V=V_TEST, fn=lm_ce_returns_logits):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, S, H, generator=g).to(dtype)
    spread = 10 if fn is lm_softcap_returns_logits else 1  # logits up to about +-40: the cap matters
    w = (torch.randn(V, H, generator=g) / H**0.5 * spread).to(dtype)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[:, ::5] = -100
    return h, w, labels


def _step_using_logits(fn, inputs, up=None):
    """loss + sum(logits * c) outside the graph: the returned logits' gradient is used."""
    h, w, labels = (t.detach().clone().requires_grad_(i < 2) for i, t in enumerate(inputs))
    loss, logits = fn(h, w, labels) if up is None else fn(h, w, labels, up=up)
    c = torch.linspace(-1, 1, logits.shape[-1], dtype=torch.float64)
    total = loss.double() + (logits.double() * c).sum() * 1e-3
    return [loss.detach(), logits.detach()], list(torch.autograd.grad(total, (h, w)))


def _fused(fn=lm_ce_returns_logits, **options):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, backend="chunked_logits",
                         options={"chunk_budget_mib": BUDGET_MIB, **options})


@functools.cache
def _returns_logits_runs(fn, dtype, gradient_used=False, V=V_TEST):
    """(inputs, FP64 reference, stock Inductor's run) of a returned-logits case, the same for
    every plan: computed once per module.  ``gradient_used``: the step also differentiates
    the returned logits (``_step_using_logits``)."""
    inputs = _returns_logits_inputs(dtype, fn=fn, V=V)
    stock = torch.compile(fn, backend="inductor")
    if not gradient_used:
        return inputs, reference(fn, inputs, (0, 1)), run(stock, inputs, (0, 1))
    inputs64 = [t.double() if t.is_floating_point() else t for t in inputs]
    return inputs, _step_using_logits(fn, inputs64, up=torch.float64), _step_using_logits(stock, inputs)


@pytest.mark.sampled(3)
@pytest.mark.parametrize("fn,dtype,out_rtol,grad_rtol,plan",
                         dtype_matrix(RETURNS_LOGITS, CPU_PLANS, ids=lambda f: f.__name__), indirect=["plan"])
def test_returned_logits_fused_and_no_less_accurate(fn, dtype, out_rtol, grad_rtol, plan):
    """Only the loss's gradient is used (the logits' is the autograd engine's zeros): the
    lm_head fuses, the returned logits (softcapped too) are stock's (``assert_stock_logits``), and the
    loss and gradients are no further from FP64 than stock's."""
    inputs, ref, stock = _returns_logits_runs(fn, dtype)
    c, ours, _ = _ours_returning_logits(fn, dtype, plan)
    assert c.get("lm_head_fused") == 1, c
    assert c.get("lm_head_returns_logits") == 1, c
    assert_stock_logits(ours[0][1], stock[0][1])
    assert_no_less_accurate(ours, stock, ref, dtype, out_rtol, grad_rtol)


@pytest.mark.sampled
@pytest.mark.parametrize("fn,dtype,out_rtol,grad_rtol,plan",
                         dtype_matrix(RETURNS_LOGITS, CPU_PLANS, ids=lambda f: f.__name__), indirect=["plan"])
def test_returned_logits_gradient_used_stays_correct(fn, dtype, out_rtol, grad_rtol, plan):
    """The caller differentiates through the returned logits too: the backward adds their
    gradient per tile, and the gradients are no further from FP64 than stock's."""
    _check_returned_logits_gradient_used(fn, dtype, out_rtol, grad_rtol, plan)


def test_gpu_plan_returned_logits_gradient_used():
    """The same through the "gpu" plan (one case: its loop is the same for every region)."""
    with cpu_out_dtype_kernels():
        _check_returned_logits_gradient_used(lm_ce_returns_logits, *TOLERANCES[0].values, "gpu", budget_mib=1)


@functools.cache
def _ours_returning_logits(fn, dtype, plan):
    """(counters, the run of the loss's gradient, (the step using the logits' gradient, the
    counters after it)) of one compile of a returned-logits case on a CPU plan: both tests
    above read the same program (the step's run compiles nothing more: its counters)."""
    inputs = _returns_logits_inputs(dtype, fn=fn)
    fused = _fused(fn, lm_head_plan=plan)
    ours = run(fused, inputs, (0, 1))
    c = dict(counters["chunked_logits"])
    return c, ours, (_step_using_logits(fused, inputs), dict(counters["chunked_logits"]))


def _check_returned_logits_gradient_used(fn, dtype, out_rtol, grad_rtol, plan, budget_mib=BUDGET_MIB):
    inputs, ref, stock = _returns_logits_runs(fn, dtype, gradient_used=True)
    if plan in CPU_PLANS and budget_mib == BUDGET_MIB:
        ours, c = _ours_returning_logits(fn, dtype, plan)[2]
    else:
        ours = _step_using_logits(_fused(fn, lm_head_plan=plan, chunk_budget_mib=budget_mib), inputs)
        c = dict(counters["chunked_logits"])
    assert c.get("lm_head_returns_logits") == 1, c
    # positive control: the logits' gradient moves the result (a test that drops it fails)
    loss_only = _returns_logits_runs(fn, dtype)[2]
    assert max_err(loss_only[1][1], ref[1][1]) > 10 * max_err(stock[1][1], ref[1][1])
    assert_no_less_accurate(ours, stock, ref, dtype, out_rtol, grad_rtol)


def test_returned_logits_no_logits_sized_gradient_in_generated_code():
    """Stock's backward allocates the logits' [T, V] gradient (the engine's zeros tangent
    plus the loss's gradient); the fused backward allocates nothing of that size (the
    zeros come from the autograd engine, outside the generated code)."""
    T, V = 96, 4096
    h, w, labels = _returns_logits_inputs(torch.bfloat16, B=1, S=T, V=V)

    def codes(fn):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        return compiled_codes(lambda: fn(hh, ww, labels)[0].backward())[1]

    def logits_sized(cs):
        return [a for c in cs for a in allocations(c) if a[0] in ((str(T), str(V)), ("1", str(T), str(V)))]

    stock = codes(torch.compile(lm_ce_returns_logits, backend="inductor"))
    ours = codes(_fused(chunk_budget_mib=32))
    assert counters["chunked_logits"]["lm_head_returns_logits"] == 1
    assert logits_sized(stock), "positive control: stock allocates [T, V] buffers"
    assert logits_sized(ours) == [], logits_sized(ours)


def test_returned_logits_not_fused_when_the_region_reads_a_slice(caplog):
    def sliced(hidden, weight, labels):  # the region reads logits[:, :-1]; the graph returns all rows
        logits = F.linear(hidden, weight)
        return F.cross_entropy(logits.float()[:, :-1].flatten(0, 1), labels[:, 1:].flatten()), logits

    h, w, labels = _returns_logits_inputs(torch.bfloat16, S=8, V=64)
    with caplog.at_level("INFO", logger="fx_passes"):
        torch.compile(sliced, backend="chunked_logits")(h, w, labels)
    assert dict(counters["chunked_logits"]) == {"rewritten": 1, "lm_head_not_fused": 1}
    assert "reads a slice of them" in caplog.text, caplog.text


def test_returned_logits_dynamic_lengths_one_outer_graph():
    """dynamic=True: the returned logits' shape is symbolic; one outer graph for every length,
    the logits stock's (``assert_stock_logits``; stock's forward: the only results read of it)."""
    fn = torch.compile(lm_ce_returns_logits, backend="chunked_logits", dynamic=True)
    stock = torch.compile(lm_ce_returns_logits, backend="inductor", dynamic=True)
    graphs = None
    for S in (37, 50, 23):
        inputs = _returns_logits_inputs(torch.bfloat16, S=S, V=5000)
        ours, st = run(fn, inputs, (0, 1)), run(stock, inputs, ())
        assert_stock_logits(ours[0][1], st[0][1])
        graphs = graphs or counters["stats"]["unique_graphs"]
    assert counters["chunked_logits"]["lm_head_returns_logits"] == 1
    assert counters["stats"]["unique_graphs"] == graphs


def test_aot_autograd_passes_zeros_for_an_unused_logits_gradient():
    """What docs/models.md says of stock torch: a returned output's gradient is a [T, V]
    tangent input of the compiled backward, and when only the loss is differentiated the
    autograd engine passes zeros (so that buffer exists whatever the pass does).  If torch
    starts passing None here, the fused loop could skip it: this test says when."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def bw_compiler(gm, _):
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        inner = make_boxed_func(gm.forward)

        def call(args):
            seen.extend(a for name, a in zip(names, args) if name.startswith("tangents"))
            return inner(args)
        call._boxed_call = True
        return call

    T, V = 8, 64
    h, w, labels = _returns_logits_inputs(torch.bfloat16, B=1, S=T, V=V)
    def fw_compiler(gm, _):
        return make_boxed_func(gm.forward)

    fn = torch.compile(lm_ce_returns_logits, backend=aot_autograd(fw_compiler=fw_compiler,
                                                                 bw_compiler=bw_compiler))
    loss, logits = fn(h.requires_grad_(), w.requires_grad_(), labels)
    assert logits.requires_grad
    loss.backward()
    grads = [t for t in seen if t is not None and t.dim() and t.shape[-1] == V]
    assert len(grads) == 1 and grads[0].numel() == T * V and grads[0].dtype == torch.bfloat16
    assert not grads[0].any(), "the logits' unused gradient is zeros"
