"""lm_head inside the chunk: the logits matmul runs per row chunk (forward) and per
vocabulary block (backward), so not even the model-precision logits exist whole."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from benchmarks.workloads import WORKLOADS, run_step
from tests.codegen import allocations, step_codes
from tests.numerics import F32, TOLERANCES, assert_no_less_accurate, reference, run


def lm_logprob_entropy(hidden, weight, tok, adv, up=F32):
    logits = hidden @ weight.T
    z = logits.to(up) / 0.7
    logp = torch.log_softmax(z, -1)
    entropy = -(torch.softmax(z, -1) * logp).sum(-1)
    lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    return -(lp * adv.to(up)).mean() - 0.01 * entropy.mean()


def lm_ce_bias_shift(hidden, weight, bias, labels, up=F32):
    # [B, S, H] hidden states, next-token shift, bias, HF-style flatten
    logits = F.linear(hidden[:, :-1], weight, bias)
    return F.cross_entropy(logits.to(up).reshape(-1, weight.shape[0]), labels[:, 1:].reshape(-1),
                           ignore_index=-100)


def lm_tied(ids, weight, labels, up=F32):
    hidden = torch.tanh(F.embedding(ids, weight))  # the same weight embeds and projects
    logits = hidden @ weight.t()
    return F.cross_entropy(logits.to(up), labels, reduction="sum")


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
    if name == "tied":
        ids = torch.randint(0, V, (T,), generator=g)
        return lm_tied, (ids, w, torch.randint(0, V, (T,), generator=g)), (1,)
    raise KeyError(name)


@pytest.mark.parametrize("dtype,out_rtol,grad_rtol", TOLERANCES)
@pytest.mark.parametrize("name", ["logprob_entropy", "ce_bias_shift", "tied"])
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
