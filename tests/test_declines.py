"""Graphs the pass must leave alone, the div-by-one removal, and the backend's switches."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from fx_passes import Config, Reason
from fx_passes.match.upcast_regions import find_regions
from fx_passes.pipeline import ChunkedLogitsPass
from fx_passes.reporting.report import Decline
from fx_passes.rewrite.upcast_region import rewrite_region
from tests.helpers import chunked_counters, dynamo_graph, rewrite

V = 64


def bf16(*shape):
    return (torch.randn(*shape) * 3).to(torch.bfloat16)


def lp(z, tok):
    return torch.log_softmax(z, -1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def lp_and(extra):
    """log-probs plus ``extra(z)`` of the same upcast ``z``."""
    def fn(x, tok):
        z = x.float()
        return lp(z, tok), extra(z)
    return fn


DECLINES = {
    "fp32_logits": (lambda x, tok: lp(x.float(), tok), lambda: (torch.randn(8, V), torch.randint(0, V, (8,))),
                    Reason.NOT_LOW_PRECISION),
    "integer_tensor": (lambda x, tok: lp(x.float(), tok),
                       lambda: (torch.randint(0, 9, (8, V)), torch.randint(0, V, (8,))),
                       Reason.NOT_LOW_PRECISION),
    "upcast_returned": (lp_and(lambda z: z), lambda: (bf16(8, V), torch.randint(0, V, (8,))),
                        Reason.ESCAPES),
    "log_softmax_returned": (lambda x, tok: torch.log_softmax(x.float(), -1), lambda: (bf16(8, V), None),
                             Reason.ESCAPES),
    "reduction_over_rows": (lp_and(lambda z: torch.sigmoid(z).sum()),
                            lambda: (bf16(8, V), torch.randint(0, V, (8,))), Reason.NOT_ROW_LOCAL),
    "vocab_of_one": (lambda x, tok: lp(x.float(), tok),
                     lambda: (bf16(8, 1), torch.zeros(8, dtype=torch.long)), Reason.VOCAB_TOO_SMALL),
    "softmax_over_rows": (lambda x, tok: torch.log_softmax(x.float(), 0).gather(-1, tok[:, None]),
                          lambda: (bf16(8, V), torch.randint(0, V, (8,))), Reason.NOT_ROW_LOCAL),
    "two_token_tensors": (lambda x, a, b: (lp(x.float(), a), lp(x.float(), b)),
                          lambda: (bf16(8, V), torch.randint(0, V, (8,)), torch.randint(0, V, (8,))),
                          None),  # two upcasts: each is its own region, both rewritten
}

# What the hand-derived path declines and the row-local path takes (issue 21): rewritten,
# the same results as eager.  (tests/test_row_local.py holds them to FP64 and to stock.)
ROW_LOCAL = {
    "sigmoid_consumer": (lp_and(lambda z: torch.sigmoid(z).sum(-1)),
                         lambda: (bf16(8, V), torch.randint(0, V, (8,))), Reason.UNKNOWN_OP),
    "per_row_temperature": (lambda x, tok, t: lp(x.float() / t, tok),
                            lambda: (bf16(8, V), torch.randint(0, V, (8,)), torch.rand(8, 1) + 0.5),
                            Reason.TEMPERATURE),
    "label_smoothing": (lambda x, y: F.cross_entropy(x.float(), y, label_smoothing=0.1),
                        lambda: (bf16(8, V), torch.randint(0, V, (8,))), Reason.LOSS_OPTIONS),
    "class_weights": (lambda x, y, w: F.cross_entropy(x.float(), y, weight=w),
                      lambda: (bf16(8, V), torch.randint(0, V, (8,)), torch.rand(V)), Reason.LOSS_OPTIONS),
    "gather_of_k_tokens": (lambda x, idx: torch.log_softmax(x.float(), -1).gather(-1, idx),
                           lambda: (bf16(8, V), torch.randint(0, V, (8, 3))), Reason.INDEX_SHAPE),
    "masked_fill_of_logprobs": (lambda x, tok, mask: torch.log_softmax(x.float(), -1).masked_fill(mask, 0.0)
                                .gather(-1, tok.unsqueeze(-1)),
                                lambda: (bf16(8, V), torch.randint(0, V, (8,)), torch.rand(8, V) < 0.1),
                                Reason.UNKNOWN_OP),
}


@pytest.mark.parametrize("name", sorted(ROW_LOCAL))
def test_row_local_takes_what_the_hand_derived_path_declines(name):
    fn, make, reason = ROW_LOCAL[name]
    args = make()
    counters.clear()
    _, after = rewrite(fn, *args, row_local=False)
    assert chunked_counters() == {"declined": 1, f"declined:{reason.name}": 1}
    counters.clear()
    torch._dynamo.reset()
    # (the engine, also where stock Inductor would be left the region: tests/test_worth.py)
    got = torch.compile(fn, backend="chunked_logits", options={"leave_to_stock": False})(*args)
    assert chunked_counters() == {"rewritten": 1, "row_local": 1}
    expected = fn(*args)
    for g, e in zip(*(o if isinstance(o, tuple) else (o,) for o in (got, expected))):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.sampled
@pytest.mark.parametrize("name", sorted(DECLINES))
def test_declined_graph_is_left_as_it_was(name):
    fn, make, reason = DECLINES[name]
    args = [a for a in make() if a is not None] if name == "log_softmax_returned" else make()
    if name == "log_softmax_returned":
        fn = lambda x: torch.log_softmax(x.float(), -1)  # noqa: E731
    expected = torch.compile(fn, backend="inductor")(*args)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="chunked_logits")(*args)
    c = chunked_counters()
    if reason is None:
        assert c.get("rewritten") == 2
        return
    assert c.get("declined") == 1 and c.get(f"declined:{reason.name}") == 1, c
    assert "rewritten" not in c
    for g, e in zip(*(o if isinstance(o, tuple) else (o,) for o in (got, expected))):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_declined_rewrite_leaves_the_graph_byte_identical():
    """rewrite_region checks everything before it edits: a region it declines (here two
    losses with different ignore_index, found only at rewrite time) leaves the graph as
    it was, not with replayed views or a mask node left behind."""
    def fn(x, labels):
        z = x[:, :-1].float().reshape(-1, V)
        y = labels[:, 1:].reshape(-1)
        return F.cross_entropy(z, y, reduction="sum"), F.cross_entropy(z, y, ignore_index=3)

    graph = dynamo_graph(fn, bf16(2, 5, V), torch.randint(0, V, (2, 5))).graph
    before = (str(graph), graph.python_code("self").src)
    (region,) = find_regions(graph)
    with pytest.raises(Decline) as info:
        rewrite_region(graph, region, Config())
    assert info.value.reason is Reason.LOSS_OPTIONS and "different ignore_index" in str(info.value)
    assert (str(graph), graph.python_code("self").src) == before


def test_decline_is_logged_with_reason(caplog):
    with caplog.at_level("INFO", logger="fx_passes"):
        rewrite(lp_and(lambda z: z), bf16(8, V), torch.randint(0, V, (8,)))
    assert "declined region at z" in caplog.text
    assert Reason.ESCAPES.value in caplog.text and "graph output" in caplog.text


def test_report_only_counts_but_changes_nothing():
    before, after = rewrite(lambda x, tok: lp(x.float() / 0.7, tok), bf16(8, V), torch.randint(0, V, (8,)),
                            report_only=True)
    assert before == after
    assert chunked_counters() == {"would_rewrite": 1}


def test_kill_switch_disables_the_backend(monkeypatch):
    monkeypatch.setenv("CHUNKED_LOGITS_DISABLE", "1")
    compiled = torch.compile(lambda x, tok: lp(x.float(), tok), backend="chunked_logits")
    compiled(bf16(8, V), torch.randint(0, V, (8,)))
    assert chunked_counters() == {}


# --- divide / multiply by one -------------------------------------------------------

def test_div_by_one_removed_everywhere():
    def fn(h, w):
        y = (h / 1.0) @ w  # not a logits pattern at all
        return (y * 1).relu()

    before, after = rewrite(fn, torch.randn(4, 8), torch.randn(8, 8))
    assert "/ 1.0" in before and "* 1" in before
    assert "/ 1.0" not in after and "* 1" not in after
    assert chunked_counters() == {"div_by_one_removed": 2}


def test_div_by_one_kept_where_output_would_alias():
    _, after = rewrite(lambda x: (x / 1.0, x.sin()), torch.randn(4))
    assert "/ 1.0" in after  # x / 1.0 returned: removing it would return the input itself
    _, after = rewrite(lambda x: (x.sin() / 1, x.sin()), torch.randn(4))
    assert "/ 1" in after or chunked_counters().get("div_by_one_removed") == 1


def test_div_by_one_kept_when_dtype_changes_or_runtime_value():
    _, after = rewrite(lambda x: (x / 1).sum(), torch.arange(4))  # int / 1 -> float
    assert "/ 1" in after
    _, after = rewrite(lambda x, t: (x / t).sin(), torch.randn(4), torch.tensor(1.0))
    assert "/ l_t_" in after  # a tensor temperature is a runtime value
    assert "div_by_one_removed" not in chunked_counters()


def test_fp16_large_logits_stay_finite():
    x = torch.full((4, 1024), 60000.0, dtype=torch.float16)
    x[:, 0] = 65000.0
    tok = torch.zeros(4, dtype=torch.long)
    fn = torch.compile(
        lambda x, tok: (lp(x.float(), tok), -(x.float().softmax(-1) * x.float().log_softmax(-1)).sum(-1)),
        backend="chunked_logits")
    logprob, entropy = fn(x, tok)
    assert chunked_counters()["rewritten"] == 2  # the log-prob (row_stats), the entropy (row_local)
    assert torch.isfinite(logprob).all() and torch.isfinite(entropy).all()


# --- settings and the backend as users meet it ---------------------------------------

def test_unknown_option_is_a_clear_error():
    fn = torch.compile(lambda x: x.float().log_softmax(-1).sum(), backend="chunked_logits",
                       options={"temperature_after_upcats": False})
    with pytest.raises(Exception, match="did you mean 'temperature_after_upcast'"):
        fn(bf16(4, V))


def test_uuid_changes_with_config():
    assert ChunkedLogitsPass(Config()).uuid() != ChunkedLogitsPass(Config(report_only=True)).uuid()
    assert ChunkedLogitsPass(Config()).uuid() == ChunkedLogitsPass(Config()).uuid()


def test_backend_name_works_in_a_fresh_process_without_import():
    code = (
        "import sys, torch\n"
        "f = torch.compile(lambda x: torch.log_softmax(x.float(), -1).amax(-1).sum(),\n"
        "                  backend='chunked_logits')\n"
        "x = torch.randn(4, 8, dtype=torch.bfloat16)\n"
        "torch.compile(lambda x: x.float().logsumexp(-1), backend='chunked_logits')(x)\n"
        "from torch._dynamo.utils import counters\n"
        "print(dict(counters['chunked_logits']), 'fx_passes' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CHUNKED_LOGITS_DISABLE": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("{'rewritten': 1} True"), out.stdout


def test_float_temperature_is_constant_when_static_and_input_when_dynamic():
    def fn(x, t):
        return (x / t).sin()

    _, static = rewrite(fn, torch.randn(4), 1.0)
    assert "/" not in static and chunked_counters() == {"div_by_one_removed": 1}
    counters.clear()
    _, dynamic = rewrite(fn, torch.randn(4), 1.0, dynamic=True)
    assert "item()" in dynamic and "/ item" in dynamic and chunked_counters() == {}
    with torch._dynamo.config.patch(specialize_float=True):
        _, specialized = rewrite(fn, torch.randn(4), 1.0, dynamic=True)
    assert "/" not in specialized


# ---- candidates that are not logits: not counted as declines (issue 11) ------------------------

def eager_attention(q, k, v):
    """An eager attention layer (Gemma2's): FP32 softmax over the keys, back to bf16."""
    scores = q @ k.transpose(-2, -1) / 8.0
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return probs @ v


def moe_router(hidden, gate):
    """An MoE router (Qwen3-MoE's): FP32 softmax over the experts, then top-k."""
    weights = F.softmax(hidden @ gate.T, dim=1, dtype=torch.float)
    top, idx = torch.topk(weights, 2, dim=-1)
    return top / top.sum(dim=-1, keepdim=True), idx


NOT_LOGITS = {
    "attention": (eager_attention, lambda: (bf16(2, 4, 16, 8), bf16(2, 4, 16, 8), bf16(2, 4, 16, 8))),
    "router": (moe_router, lambda: (bf16(32, 16), bf16(8, 16))),
}


@pytest.mark.parametrize("name", sorted(NOT_LOGITS))
def test_not_logits_are_not_declines_and_show_at_debug(name, caplog):
    fn, make = NOT_LOGITS[name]
    args = make()
    with caplog.at_level("DEBUG", logger="fx_passes"):
        got = torch.compile(fn, backend="chunked_logits")(*args)
    assert chunked_counters() == {}, "not logits: nothing rewritten, nothing declined"
    assert "not a reduction over a vocabulary" in caplog.text
    torch._dynamo.reset()
    stock = torch.compile(fn, backend="inductor")(*args)
    for g, s in zip(*(o if isinstance(o, tuple) else (o,) for o in (got, stock))):
        torch.testing.assert_close(g, s, rtol=0, atol=0)


def test_an_unknown_op_on_logits_is_still_a_decline():
    """The control: an op that is not row-local (``flip`` of the rows) on logits that are
    reduced per row is a decline, naming the op."""
    def fn(x, tok):
        logp = torch.log_softmax(x.float(), -1).flip(0)
        return logp.gather(-1, tok.unsqueeze(-1))

    torch.compile(fn, backend="chunked_logits")(bf16(8, V), torch.randint(0, V, (8,)))
    assert chunked_counters() == {"declined": 1, "declined:NOT_ROW_LOCAL": 1}
