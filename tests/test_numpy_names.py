"""NumPy's argument names on torch's ops (NOTE [numpy names] in
``fx_passes/rewrite/numpy_names.py``): OpenRLHF's and verl's ``masked_mean`` write
``(x * mask).sum(axis=dim) / mask.sum(axis=dim)``.  Before, the loss tail was declined
(``sum's keyword argument axis=None is not in the op table``): no gradients in the forward
and every padding row ran.  Now ``axis`` / ``keepdims`` read as ``dim`` / ``keepdim``, as
torch's argument parser reads them, and the loss is taken."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fx_passes.rewrite import numpy_names
from tests.grpo_losses import compare, inputs, logps, padding_skipped
from tests.helpers import chunked_counters
from tests.numerics import F32, TOLERANCES

BF16, FP16 = TOLERANCES


def openrlhf_masked_mean(x, mask, dim=None):
    return (x * mask).sum(axis=dim) / mask.sum(axis=dim)


def verl_masked_mean(x, mask, axis=None):
    """verl's NaN-safe ``masked_sum`` (a ``where`` first), over ``mask.sum(axis) + 1e-8``."""
    return (torch.where(mask.bool(), x, 0.0) * mask).sum(axis=axis) / (mask.sum(axis=axis) + 1e-8)


def openrlhf_policy_loss(token_level: bool, kl: bool):
    """OpenRLHF's ``PolicyLoss`` on token advantages (``token_level_loss`` or a mean per
    sequence), plus its ``k1`` KL estimate to a reference, clamped, with its coefficient."""
    def fn(hidden, weight, tokens, old, adv, mask, up=F32):
        lp = logps(hidden, weight, tokens, up)
        old, adv = old.to(up), adv.to(up).unsqueeze(1).expand_as(old)
        ratio = (lp - old).exp()
        loss = -torch.min(ratio * adv, ratio.clamp(1 - 0.2, 1 + 0.28) * adv)
        if kl:
            loss = loss + 0.01 * (lp - (old + 0.05)).clamp(min=-10, max=10)
        if token_level:
            return openrlhf_masked_mean(loss, mask, dim=None)
        return openrlhf_masked_mean(loss, mask, dim=-1).mean()
    fn.__name__ = f"openrlhf_{'token' if token_level else 'sequence'}{'_kl' if kl else ''}"
    return fn


def verl_agg_loss(mode: str):
    """verl's ``agg_loss`` of its vanilla policy loss (``maximum`` of the two surrogates)."""
    def fn(hidden, weight, tokens, old, adv, mask, up=F32):
        ratio = torch.exp(torch.clamp(logps(hidden, weight, tokens, up) - old.to(up), min=-20.0, max=20.0))
        adv = adv.to(up).unsqueeze(1)
        loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - 0.2, 1 + 0.2))
        if mode == "token-mean":
            return verl_masked_mean(loss, mask)
        return verl_masked_mean(loss, mask, axis=-1).mean()
    fn.__name__ = f"verl_{mode}"
    return fn


def verl_actor_loss(hidden, weight, tokens, old, adv, mask, up=F32):
    """verl's actor loss: the policy loss, an entropy bonus and the ``low_var_kl`` penalty,
    each a ``"token-mean"`` (``masked_mean``), on temperature-scaled FP32 logits."""
    logits = (hidden @ weight.T).to(up) / 0.7
    lp = torch.gather(torch.log_softmax(logits, dim=-1), -1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = torch.logsumexp(logits, dim=-1) - torch.sum(torch.softmax(logits, dim=-1) * logits, dim=-1)
    ratio = torch.exp(torch.clamp(lp - old.to(up), min=-20.0, max=20.0))
    adv = adv.to(up).unsqueeze(1)
    pg = verl_masked_mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2)), mask)
    kl = torch.clamp(old.to(up) + 0.05 - lp, min=-20, max=20)
    kl = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    return pg - 0.001 * verl_masked_mean(entropy, mask) + 0.001 * verl_masked_mean(kl, mask)


LOSSES = [*(openrlhf_policy_loss(token, kl) for kl in (False, True) for token in (True, False)),
          verl_agg_loss("token-mean"), verl_agg_loss("seq-mean-token-mean"), verl_actor_loss]


@pytest.mark.parametrize("fn", LOSSES, ids=lambda f: f.__name__)
def test_losses_with_numpy_names_taken_and_padding_skipped(fn):
    data = inputs(torch.bfloat16)
    c = compare(fn, data, BF16, "two_sweeps")
    assert c.get("gradients_in_forward") == 1 and c.get("numpy_names_renamed", 0) >= 1, c
    assert padding_skipped(c, data), c


def test_fp16_gpu_plan_and_dynamic_shapes():
    data = inputs(torch.float16)
    for plan, dynamic in (("gpu", False), ("two_sweeps", True)):
        c = compare(openrlhf_policy_loss(False, True), data, FP16, plan, dynamic)
        assert c.get("gradients_in_forward") == 1 and c.get("per_sequence_sums") == 1, (plan, dynamic, c)


def _names(x, mask):
    a = x.sum(axis=-1, keepdims=True)            # method: renamed
    b = torch.mean(x, axis=None)                 # torch builtin, dim=None: dropped
    c = x.sum(axis=None, keepdims=True)          # dim=None kept where keepdim=True
    d = torch.amax(x, axis=0)                    # any op the parser reads
    e = openrlhf_masked_mean(x, mask, dim=1)     # (inlined: two sums)
    f = torch.nn.functional.softmax(x, dim=-1)   # already torch's names
    return a, b, c, d, e, f


def test_calls_renamed_as_torch_parses_them():
    gm = torch.fx.symbolic_trace(_names)
    x, mask = torch.randn(3, 5), (torch.rand(3, 5) > 0.3).float()
    FakeTensorProp(gm).propagate(x, mask)  # (the example values Dynamo's graphs carry)
    want = gm(x, mask)
    assert numpy_names.torch_names(gm.graph) == 6
    gm.recompile()
    got = gm(x, mask)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    kwargs = [dict(n.kwargs) for n in gm.graph.nodes if n.op in ("call_method", "call_function") and n.kwargs]
    assert {"dim": -1, "keepdim": True} in kwargs and {"dim": None, "keepdim": True} in kwargs
    assert {"dim": 0} in kwargs and {"dim": 1} in kwargs
    (mean,) = [n for n in gm.graph.nodes if n.target is torch.mean]
    assert mean.kwargs == {}
    assert not any("axis" in k or "keepdims" in k for k in kwargs)


def test_python_functions_and_both_spellings_not_renamed():
    """``axis=`` of a Python function is its own argument; both spellings at once are the
    parser's error, left for it to raise."""
    def user_fn(x, axis=None):
        return x * (2 if axis is None else 3)

    def f(x):
        return user_fn(x, axis=1), torch.nn.functional.normalize(x, dim=0)

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(3, 4)
    graph.output((graph.call_function(user_fn, (x,), {"axis": 1}),
                  graph.call_method("sum", (x,), {"axis": 0, "dim": 0})))
    assert numpy_names.torch_names(graph) == 0
    gm = torch.fx.symbolic_trace(f)
    FakeTensorProp(gm).propagate(torch.randn(3, 4))
    assert numpy_names.torch_names(gm.graph) == 0


def test_a_graph_with_no_region_keeps_its_names(caplog):
    """Renamed only where a region is then rewritten: elsewhere the user's spelling."""
    def f(x):
        return x.sum(axis=-1) * 2

    x = torch.randn(4, 6)
    with caplog.at_level(logging.INFO, logger="fx_passes"):
        out = torch.compile(f, backend="chunked_logits")(x)
    assert torch.allclose(out, f(x))
    assert "numpy_names_renamed" not in chunked_counters()
    assert "the graph's own spelling kept (numpy_names_renamed 1 undone)" in caplog.text
