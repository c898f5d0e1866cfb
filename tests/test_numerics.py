"""Numerics against an FP64 reference: the rewritten path may not be less accurate
than stock torch.compile (Inductor) on the same graph.

Each case is written with the upcast dtype as a parameter ``up``: the compiled runs
use ``up=torch.float32`` (what users write), the reference runs the same maths with
``up=torch.float64`` on the same inputs.  Every case also asserts that the pass
rewrote the graph, so a decline can never pass a numerics test.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.utils import counters

from tests.cases import (
    cross_entropy,
    entropy_lse_form,
    labels_for,
    logits,
    logprob,
    logprob_entropy,
    policy_loss,
    shifted_bsv,
    tokens_for,
)
from tests.numerics import F32, assert_no_less_accurate, dtype_matrix, max_err, reference, run


def make_case(name, dtype):
    """(fn, inputs, grad positions) of a named case."""
    if name == "logprob_V50257_T37":
        x = logits(37, 50257, dtype)
        return logprob, (x, tokens_for(x)), ()
    if name == "logprob_T1":
        x = logits(1, 4096, dtype)
        return logprob, (x, tokens_for(x)), ()
    if name == "logprob_masked_-inf":
        x = logits(64, 1000, dtype, mask_frac=0.3)
        return policy_loss_logprob_only, (x, tokens_for(x), torch.randn(64)), (0,)
    if name == "logprob_entropy_scoring":
        x = logits(53, 3001, dtype)
        return logprob_entropy, (x, tokens_for(x)), ()
    if name == "entropy_logsumexp_form":
        return entropy_lse_form, (logits(53, 3001, dtype),), ()
    if name == "policy_loss_training":
        x = logits(53, 3001, dtype)
        return policy_loss, (x, tokens_for(x), torch.randn(53)), (0,)
    if name == "shifted_bsv_tensor_temperature":
        x = logits(3 * 17, 2048, dtype).reshape(3, 17, 2048)
        return shifted_bsv, (x, tokens_for(x), torch.tensor(0.7)), (0,)
    if name == "cross_entropy_all_ignored_mean":
        x = logits(16, 512, dtype)
        return functools.partial(cross_entropy, reduction="mean"), (x, labels_for(x, 1.0)), (0,)
    if name == "cross_entropy_masked_-inf":
        x = logits(61, 1000, dtype, mask_frac=0.3)
        return functools.partial(cross_entropy, reduction="sum"), (x, labels_for(x, 0.1)), (0,)
    if name.startswith("cross_entropy_"):
        reduction = name.split("_")[-1]
        x = logits(61, 5003, dtype, mask_frac=0.0)
        return functools.partial(cross_entropy, reduction=reduction), (x, labels_for(x, 0.1)), (0,)
    raise KeyError(name)


def policy_loss_logprob_only(x, tok, adv, up=F32):
    return -(logprob(x, tok, up) * adv.to(up)).mean()


CASES = [
    "logprob_V50257_T37", "logprob_T1", "logprob_masked_-inf", "logprob_entropy_scoring",
    "entropy_logsumexp_form", "policy_loss_training", "shifted_bsv_tensor_temperature",
    "cross_entropy_mean", "cross_entropy_sum", "cross_entropy_none",
    "cross_entropy_all_ignored_mean", "cross_entropy_masked_-inf",
]
@pytest.mark.sampled(3)
@pytest.mark.parametrize("case,dtype,out_rtol,grad_rtol", dtype_matrix(CASES))
def test_no_less_accurate_than_stock(case, dtype, out_rtol, grad_rtol):
    fn, inputs, grad_pos = make_case(case, dtype)
    ref_outs, ref_grads = reference(fn, inputs, grad_pos)

    stock_outs, stock_grads = run(torch.compile(fn, backend="inductor"), inputs, grad_pos)
    torch._dynamo.reset()
    counters.clear()
    outs, grads = run(torch.compile(fn, backend="chunked_logits"), inputs, grad_pos)
    assert counters["chunked_logits"]["rewritten"] >= 1, dict(counters["chunked_logits"])

    assert_no_less_accurate((outs, grads), (stock_outs, stock_grads), (ref_outs, ref_grads),
                            dtype, out_rtol, grad_rtol)


def test_dynamic_shapes_match_reference_across_lengths():
    fn = torch.compile(logprob_entropy, backend="chunked_logits", dynamic=True)
    for T in (5, 17, 64):
        x = logits(T, 1000, torch.bfloat16, seed=T)
        tok = tokens_for(x)
        outs, _ = run(fn, (x, tok), ())
        ref, _ = reference(logprob_entropy, (x, tok), ())
        stock, _ = run(functools.partial(logprob_entropy), (x, tok), ())  # eager FP32 path
        for got, r, s in zip(outs, ref, stock):
            assert max_err(got, r) <= max_err(s, r) + 2e-6 * r.abs().max().item()
    assert counters["chunked_logits"]["rewritten"] == 1  # one graph for every length


@pytest.mark.parametrize("fn", [logprob, logprob_entropy], ids=["logprob", "logprob_entropy"])
def test_confident_tokens_keep_their_relative_accuracy(fn):
    """A token with p near 1 has a log-prob near 0; PPO ratios exp(new - old) need it
    to the same relative accuracy as stock's log_softmax, (z - m) - log s, gives.
    (z - lse, with lse rounded at the scale of the max logit, measured 2x stock's error.)"""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(512, 4096, generator=g) * 3).bfloat16()
    x[:, 7] = 14  # z = 20 against a max of about 16 elsewhere: p of token 7 mostly above 0.9
    tok = torch.full((512,), 7)
    ref = logprob(x, tok, up=torch.float64)
    assert ref.abs().median() < 0.1  # confident
    with torch.no_grad():
        stock = torch.compile(fn, backend="inductor")(x, tok)
        torch._dynamo.reset()
        ours = torch.compile(fn, backend="chunked_logits")(x, tok)
    assert counters["chunked_logits"]["rewritten"] == 1
    stock, ours = (o[0] if isinstance(o, tuple) else o for o in (stock, ours))

    def rel(got):
        return ((got.double() - ref).abs() / ref.abs()).max().item()
    assert rel(ours) <= rel(stock) * 1.01 + 1e-7
