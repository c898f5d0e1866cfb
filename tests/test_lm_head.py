"""lm_head inside the chunk: the logits matmul runs per row chunk (forward) and per
vocabulary block (backward), so not even the model-precision logits exist whole."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.workloads import WORKLOADS, run_step
from tests.cases import lm_logprob_entropy
from tests.codegen import allocations, step_codes
from tests.numerics import F32, TOLERANCES, assert_no_less_accurate, reference, run


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


def _inputs(name, dtype, T=61, H=32, V=50257):
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


@pytest.mark.parametrize("dtype,out_rtol,grad_rtol", TOLERANCES)
@pytest.mark.parametrize("name", ["logprob_entropy", "ce_bias_shift", "tied", "softcap", "scaled"])
def test_lm_head_numerics_no_worse_than_stock(name, dtype, out_rtol, grad_rtol):
    fn, inputs, grad_pos = _inputs(name, dtype)
    ref_outs, ref_grads = reference(fn, inputs, grad_pos)
    stock_outs, stock_grads = run(torch.compile(fn, backend="inductor"), inputs, grad_pos)
    torch._dynamo.reset()
    counters.clear()
    # a small budget: several row chunks and vocabulary blocks, T not divisible by either
    fused = torch.compile(fn, backend="chunked_logits", options={"chunk_budget_mib": 1})
    outs, grads = run(fused, inputs, grad_pos)
    assert counters["chunked_logits"]["lm_head_fused"] == 1, dict(counters["chunked_logits"])
    assert_no_less_accurate((outs, grads), (stock_outs, stock_grads), (ref_outs, ref_grads),
                            dtype, out_rtol, grad_rtol)


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


def test_loop_bodies_compile_once_across_calls_and_grad_modes():
    """Was a gap: the bodies compiled again on the second call (a dispatch-key and a
    requires_grad guard) and at every grad-mode change."""
    w = WORKLOADS["W4"]
    fn = torch.compile(w.fn, backend="chunked_logits", dynamic=True)
    inputs = w.make(64, 512)
    run_step(w, fn, inputs)  # compiles the outer graphs and both bodies
    compiled = counters["stats"]["unique_graphs"]
    assert compiled == 3  # the outer graph, the forward body, the backward body
    for _ in range(2):
        run_step(w, fn, inputs)
    with torch.no_grad():  # scoring: a new outer graph (grad mode), the same forward body
        fn(*inputs)
    assert counters["stats"]["unique_graphs"] == compiled + 1


class _LargestFP32(TorchDispatchMode):
    """The element count of the largest FP32 tensor any op allocates (views excluded)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and not t._is_view():
                self.largest = max(self.largest, t.numel())
        return out


def _backward_inputs(T, H, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).bfloat16()
    weight = (torch.randn(V, H, generator=g) / H**0.5).bfloat16()
    tokens = torch.randint(0, V, (T,), generator=g)
    lse = torch.logsumexp((hidden.double() @ weight.double().T), -1).float()
    g_rows = torch.randn(3, T, generator=g)
    return hidden, weight, tokens, lse, g_rows


@pytest.mark.parametrize("budget", [2**20, 48 * 2**10])  # one sweep; several (T rows in groups of 96)
def test_backward_has_no_fp32_buffer_of_all_rows(budget, monkeypatch):
    """Was a gap (issue 10): grad_hidden was accumulated in an FP32 [T, H] buffer.  Now
    a group of rows at a time is (an FP32 [S, H] buffer, S from the budget), and the
    gradients are the same with one sweep or several."""
    import fx_passes.lm_head as lm_head
    monkeypatch.setattr(lm_head, "compiled", lambda fn: fn)  # eager bodies: every op is seen
    T, H, V = 300, 64, 512
    hidden, weight, tokens, lse, (g_lse, g_lp, g_ent) = _backward_inputs(T, H, V)
    with _LargestFP32() as mode:
        gh, gw, _ = lm_head.lm_head_grads(hidden, weight, None, tokens, lse, None, g_lse, g_lp, g_ent,
                                          None, False, budget)
    groups = -(-T // lm_head.accumulator_rows(budget, T, H))
    assert (groups == 1) == (budget == 2**20)
    if groups > 1:
        assert mode.largest < T * H, "an FP32 buffer as large as [T, H]"
    # the same gradients as FP64 maths on the model-precision values, to FP32 accuracy
    x = (hidden.double() @ weight.double().T)
    p = torch.softmax(x, -1)
    onehot = torch.nn.functional.one_hot(tokens, V).double()
    grad_x = p * (g_lse - g_lp).double()[:, None] + onehot * g_lp.double()[:, None]
    grad_x = grad_x.bfloat16().double()  # the op hands the logits' gradient on in bf16
    for got, want in ((gh, grad_x @ weight.double()), (gw, grad_x.T @ hidden.double())):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-3 * want.abs().max().item())
