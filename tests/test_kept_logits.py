"""``lm_head_plan="kept_logits"`` (NOTE [kept logits], ``kernels/log_softmax/lm_head_kept.py``):
a per-token call keeps its model-precision logits from the forward; the backward writes
their gradient in their place and runs stock's two gradient GEMMs, so a step runs three
``[T, H] x [H, V]`` GEMMs, not the recomputing plans' four, and holds no FP32 ``[T, V]``,
``[V, H]`` or ``[T, H]`` buffer; its errors against FP64 are no more than stock's."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from fx_passes.kernels import tiling
from fx_passes.testing.gemms import full_gemms, recording, tracing
from tests.helpers import made_otherwise_before
from tests.numerics import TOLERANCES, assert_no_less_accurate, reference, run

T, H, V = 256, 64, 1024
F32, BF16 = torch.float32, torch.bfloat16
CPU = torch.device("cpu")
KEPT = "chunked_logits.lm_head_stats_kept.default"


def per_token(hidden, weight, tokens):
    """Per-token log-probs and entropy, as a policy loss reads them (they leave the graph)."""
    logp = torch.log_softmax((hidden @ weight.T).float() / 0.7, -1)
    return logp.gather(-1, tokens[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def returns_logits(hidden, weight, tokens):
    logits = hidden @ weight.T
    logp = torch.log_softmax(logits.float(), -1)
    return logp.gather(-1, tokens[:, None]).squeeze(-1), logits


def _inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g).to(BF16)
    w = (torch.randn(V, H, generator=g) / H**0.5).to(BF16)
    return h, w, torch.randint(0, V, (T,), generator=g), torch.randn(T, generator=g)


def _grads(fn, h, w, tokens, weights, retain=False):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    out = fn(h, w, tokens)
    loss = (out[0] * weights).sum() + (out[1].sum() if out[1].dtype == F32 else 0)
    loss.backward(retain_graph=retain)
    grads = (h.grad.clone(), w.grad.clone())
    if retain:  # the same graph's backward again: the first wrote the gradient over the kept logits
        h.grad, w.grad = None, None
        loss.backward()
        assert torch.equal(h.grad, grads[0]) and torch.equal(w.grad, grads[1])
    return grads


@pytest.fixture(scope="module")
def kept_step():
    """(the ATen calls, the GEMMs) of a step of ``per_token`` with the kept logits."""
    h, w, tokens, weights = _inputs()
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(per_token, backend="chunked_logits", options={"lm_head_plan": "kept_logits"})
    _grads(fn, h, w, tokens, weights, retain=True)  # compiles; a retained graph's two backwards agree
    with tracing() as ops:
        _grads(fn, h, w, tokens, weights)
    with recording() as gemms:
        _grads(fn, h, w, tokens, weights)
    assert counters["chunked_logits"]["kept_logits"] == 1, dict(counters["chunked_logits"])
    return ops, gemms


def test_three_gemms_a_step(kept_step):
    _, gemms = kept_step
    assert full_gemms(gemms, T, H, V) == pytest.approx(3.0)  # the recomputing plans: 4 (or 5)
    assert all(g.in_dtype == BF16 for g in gemms)


def test_the_backward_writes_over_the_kept_logits_then_runs_stocks_two_gemms(kept_step):
    ops, _ = kept_step
    names = [o.op for o in ops]
    backward = ops[names.index(KEPT) + 1:]
    gemms = [(o.op, o.shape, o.dtype) for o in backward if o.op.startswith(("aten.mm", "aten.addmm"))]
    assert gemms == [("aten.mm.default", (T, H), BF16),   # grad_hidden = g @ W, all rows
                     ("aten.mm.default", (V, H), BF16)]   # grad_weight = g.T @ h, all rows
    # no FP32 [T, V], [V, H] or [T, H] tensor anywhere in the step
    assert max(torch.Size(o.shape).numel() for o in ops if o.dtype == F32) < T * H
    # the one model-precision [T, V] buffer: the kept logits (their gradient in their place)
    assert [o.op for o in ops if o.dtype == BF16 and o.shape == (T, V) and "empty" in o.op] == [
        "aten.new_empty.default"]


def test_logits_the_graph_returns_are_not_kept():
    """The caller may change returned logits in place (TRL divides them by the temperature):
    the loop that writes them recomputes in its backward, as without the plan."""
    h, w, tokens, weights = _inputs()
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(returns_logits, backend="chunked_logits", options={"lm_head_plan": "kept_logits"})
    with tracing() as ops:
        got = _grads(fn, h, w, tokens, weights)
    names = {o.op for o in ops}
    assert "chunked_logits.lm_head_stats_logits.default" in names and KEPT not in names
    assert "kept_logits" not in counters["chunked_logits"]
    want = _grads(torch.compile(returns_logits, backend="inductor"), h, w, tokens, weights)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_a_graph_without_a_backward_keeps_nothing():
    """Scoring under ``no_grad`` (a reference model's log-probs): no backward reads the
    logits, so the call keeps none (the recomputing plan's forward)."""
    h, w, tokens, _ = _inputs()
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(per_token, backend="chunked_logits", options={"lm_head_plan": "kept_logits"})
    with torch.no_grad(), tracing() as ops:
        got = fn(h, w, tokens)
    names = {o.op for o in ops}
    assert "chunked_logits.lm_head_stats.default" in names and KEPT not in names
    assert "kept_logits" not in counters["chunked_logits"]  # (the summary says nothing is kept)
    assert not [o for o in ops if o.dtype == BF16 and torch.Size(o.shape).numel() >= T * V]  # no [T, V]
    torch.testing.assert_close(got[0], per_token(h, w, tokens)[0], atol=2e-2, rtol=2e-2)


def test_the_loops_that_keep_no_logits_run_the_devices_own_plan():
    for dtype in (BF16, torch.float16):
        assert tiling.backward_plan(CPU, dtype, "kept_logits") == tiling.backward_plan(CPU, dtype, "auto")


def lp_entropy_tok(hidden, weight, tok, up=F32):
    """A per-token policy term (log-prob and entropy bonus at a temperature): the graph returns it."""
    z = (hidden @ weight.T).to(up) / 0.7
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, tok[:, None]).squeeze(-1) + 0.01 * (torch.softmax(z, -1) * logp).sum(-1)


def softcap_bias_tok(hidden, weight, bias, tok, up=F32):
    """Gemma2's softcap on a biased lm_head, per-token log-probs."""
    logits = torch.tanh(torch.nn.functional.linear(hidden, weight, bias) / 30.0) * 30.0
    return torch.log_softmax(logits.to(up), -1).gather(-1, tok[:, None]).squeeze(-1)


def _case(name, dtype, T=61, H=32, V=4099):
    g = torch.Generator().manual_seed(0)
    h, tok = torch.randn(T, H, generator=g).to(dtype), torch.randint(0, V, (T,), generator=g)
    w = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    if name == "lp_entropy":
        return lp_entropy_tok, (h, w, tok), (0, 1)
    b = (torch.randn(V, generator=g) * 0.1).to(dtype)
    return softcap_bias_tok, (h, (w.float() * 10).to(dtype), b, tok), (0, 1, 2)


@pytest.mark.parametrize("name,dtype,out_rtol,grad_rtol", [
    pytest.param("lp_entropy", *TOLERANCES[0].values, id="lp_entropy-bf16"),
    pytest.param("softcap_bias", *TOLERANCES[1].values, id="softcap_bias-fp16"),
])
@pytest.mark.sampled
def test_numerics_no_worse_than_stock(name, dtype, out_rtol, grad_rtol):
    """Against FP64, as tests/numerics.py holds every path: several row chunks (a small
    budget), T divisible by none; a temperature, an entropy, a softcap and a bias."""
    fn, inputs, grad_pos = _case(name, dtype)
    ref, stock = reference(fn, inputs, grad_pos), run(torch.compile(fn, backend="inductor"), inputs, grad_pos)
    torch._dynamo.reset()
    counters.clear()
    fused = torch.compile(fn, backend="chunked_logits",
                          options={"chunk_budget_mib": 4099 / 50257, "lm_head_plan": "kept_logits"})
    ours = run(fused, inputs, grad_pos)
    assert counters["chunked_logits"]["kept_logits"] == 1, dict(counters["chunked_logits"])
    assert_no_less_accurate(ours, stock, ref, dtype, out_rtol, grad_rtol)


def policy_loss(hidden, weight, tok, adv, up=F32):
    """A policy-gradient loss in the graph (the lm_head, log-probs at a temperature, the mean)."""
    logp = torch.log_softmax((hidden @ weight.T).to(up) / 0.7, -1).gather(-1, tok[:, None]).squeeze(-1)
    return -(logp * adv).mean()


def test_the_loss_in_the_graph_keeps_the_logits_too():
    """With the plan chosen, a loss in the graph is not rewritten into the gradients-in-the-
    forward loop (FP32 sums, 4 GEMMs on a CPU): the per-token call keeps its logits and the
    loss stays in the graph, three GEMMs a step; against FP64 no worse than stock (bf16:
    fp16 runs the same call in the test above)."""
    dtype, out_rtol, grad_rtol = TOLERANCES[0].values
    g = torch.Generator().manual_seed(0)
    h = torch.randn(61, 32, generator=g).to(dtype)
    w = (torch.randn(4099, 32, generator=g) / 32**0.5).to(dtype)
    inputs = (h, w, torch.randint(0, 4099, (61,), generator=g), torch.randn(61, generator=g))
    ref, stock = reference(policy_loss, inputs, (0, 1)), run(torch.compile(policy_loss, backend="inductor"),
                                                              inputs, (0, 1))
    from fx_passes.reporting.session import session
    torch._dynamo.reset()
    counters.clear()
    session.reset()
    fused = torch.compile(policy_loss, backend="chunked_logits",
                          options={"chunk_budget_mib": 4099 / 50257, "lm_head_plan": "kept_logits"})
    with recording() as gemms:
        ours = run(fused, inputs, (0, 1))
    got = dict(counters["chunked_logits"])
    assert got["kept_logits"] == 1 and "gradients_in_forward" not in got, got
    assert full_gemms(gemms, 61, 32, 4099) == pytest.approx(3.0)
    # the bytes the summary says it avoided: stock's FP32 [T, V], not the bf16 logits it keeps
    assert [e.fp32_bytes_avoided for e in session.events if e.kind == "rewritten"] == [61 * 4099 * 4]
    assert_no_less_accurate(ours, stock, ref, dtype, out_rtol, grad_rtol)


@pytest.fixture
def cpu_as_a_gpu(monkeypatch):
    """``tiling.keeps_logits`` answering for this CPU as for a GPU (the rule reads the device
    type only), where the rewrites call it."""
    from fx_passes.rewrite import loss_tail

    def as_gpu(device_type, stock_fp32, plan="auto"):
        return tiling.keeps_logits("cuda" if device_type == "cpu" else device_type, stock_fp32, plan)
    monkeypatch.setattr(loss_tail, "keeps_logits", as_gpu)


def masked_policy_loss(hidden, weight, tok, adv, up=F32):
    """``policy_loss`` as a masked mean over the rows with a positive advantage."""
    logp = torch.log_softmax((hidden @ weight.T).to(up) / 0.7, -1).gather(-1, tok[:, None]).squeeze(-1)
    mask = (adv > 0).to(up)
    return -(logp * adv * mask).sum() / mask.sum()


def ce_per_token(hidden, weight, tok, adv, up=F32):
    """A cross-entropy alone, per token (its stock keeps no FP32 [T, V])."""
    return torch.nn.functional.cross_entropy((hidden @ weight.T).to(up), tok, reduction="none") * adv


@pytest.mark.parametrize("fn,options,kept", [
    (policy_loss, {}, True),
    (masked_policy_loss, {}, False),  # (its loop runs only the rows the mask keeps)
    (ce_per_token, {"skip_masked_rows": False}, False),  # (keeping would save nothing)
    (policy_loss, {"lm_head_plan": "two_sweeps"}, False),  # (a plan named: the user's)
], ids=["log_prob_loss", "masked_loss", "cross_entropy_alone", "plan_named"])
def test_auto_on_a_gpu_keeps_a_log_probs_logits(cpu_as_a_gpu, fn, options, kept):
    """``auto`` on a GPU (``tiling.keeps_logits``, the device type the one thing this CPU
    run changes): a log-prob's loss with no mask stays in the graph on the call that keeps
    its logits, three GEMMs a step, against FP64 no worse than stock; a masked loss keeps
    the loop that leaves its rows out, a cross-entropy alone and a named plan keep no logits."""
    dtype, out_rtol, grad_rtol = TOLERANCES[0].values
    g = torch.Generator().manual_seed(0)
    h = torch.randn(61, 32, generator=g).to(dtype)
    w = (torch.randn(4099, 32, generator=g) / 32**0.5).to(dtype)
    inputs = (h, w, torch.randint(0, 4099, (61,), generator=g), torch.randn(61, generator=g))
    torch._dynamo.reset()
    counters.clear()
    fused = torch.compile(fn, backend="chunked_logits", options={"chunk_budget_mib": 4099 / 50257, **options})
    with recording() as gemms:
        ours = run(fused, inputs, (0, 1))
    got = dict(counters["chunked_logits"])
    assert got["rewritten"] == 1 and bool(got.get("kept_logits")) == kept, got
    if kept:
        assert "gradients_in_forward" not in got and full_gemms(gemms, 61, 32, 4099) == pytest.approx(3.0)
        ref, stock = reference(fn, inputs, (0, 1)), run(torch.compile(fn, backend="inductor"), inputs, (0, 1))
        assert_no_less_accurate(ours, stock, ref, dtype, out_rtol, grad_rtol)
    elif fn is masked_policy_loss:  # (the loss loop or, where this CPU's plan has none, the per-token one)
        assert got["rows_skipped"] > 0, got


@pytest.mark.parametrize("transforms, scale", [
    ("", torch.tensor(0.7)),                                              # a temperature
    pytest.param(f"div:{(30.0).hex()},tanh,mul:{(30.0).hex()}", torch.tensor(0.7),  # a soft cap too
                 marks=made_otherwise_before("2.13", "Inductor keeps no soft cap tile")),
], ids=["temperature", "softcap"])
def test_the_forward_stats_read_the_kept_logits_with_no_tile(transforms, scale):
    """The forward's body (``loss.stats_of_kept``, compiled as the loop compiles it) after the
    GEMM wrote the chunk's logits into the kept buffer: with a temperature Inductor allocates
    nothing of the chunk's size, so on a GPU one chunk may hold every row
    (``tiling.kept_rows``); a soft cap's tanh, read twice, is kept in an FP32 tile (as the
    loss loop's body keeps it: tests/test_gpu_loss_chunks.py), so there the chunks stay the
    budget's.  Its stats are those of the GEMM and stats in one body (as before)."""
    from torch._inductor.utils import run_and_get_code

    from fx_passes.kernels.log_softmax import bodies, given, loss
    from fx_passes.kernels.ops import body_compiler
    from fx_passes.testing.codegen import allocations
    g = torch.Generator().manual_seed(0)
    r, h = 96, 32
    hidden, weight = torch.randn(r, h, generator=g).to(BF16), (torch.randn(V, h, generator=g) / 4).to(BF16)
    tok = torch.randint(0, V, (r,), generator=g)
    x = torch.mm(hidden, weight.t())
    z = bodies.transformed(x, transforms)[0]
    want = bodies.compiled(given.stats_and_residual)(z, tok, scale, True, True)
    with body_compiler.compiling_with(lambda fn, options: body_compiler._inductor(fn, options)):
        body = bodies.compiled(loss.stats_of_kept)
        got, codes = run_and_get_code(body, x, tok, scale, True, True, transforms)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    tiles = [(dims, dtype) for code in codes for dims, dtype in allocations(code)
             if len([d for d in dims if d != "1"]) > 1]
    assert tiles == ([] if not transforms else [(tiles[0][0], "torch.float32")]), tiles
    b, n, v = 2**31, 8192, 151936
    budgets = tiling.forward_rows(b, n, v)  # (the budget's rows)
    assert tiling.kept_rows(b, n, v, "cuda", True, transforms) == (budgets if transforms else n)
    assert tiling.kept_rows(b, n, v, "cpu") == budgets  # (and a budget the user set:)
    assert tiling.kept_rows(b, n, v, "cuda", by_device=False) == budgets
