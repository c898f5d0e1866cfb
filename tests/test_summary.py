"""``fx_passes.summary()`` / ``summary_text()``: counted per source region, not per compile;
the bytes estimate; near misses; ``report_only`` says what it would do."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fx_passes
from fx_passes.reporting import summary as exit_summary
from fx_passes.reporting.report import record_near_miss
from fx_passes.reporting.session import Session
from tests.helpers import chunked_counters, clean_env


def logprob(logits, tokens):
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)


def two_logprobs(a, b, tokens):
    return logprob(a, tokens) + logprob(b, tokens)


def ce(logits, labels):
    return F.cross_entropy(logits.float(), labels)


def data(t=8, v=64):
    return torch.randn(t, v).bfloat16(), torch.randint(0, v, (t,))


def test_one_region_compiled_static_then_dynamic_is_one_region():
    compiled = torch.compile(logprob, backend="chunked_logits")
    compiled(*data(8))
    compiled(*data(12))  # recompiles with a dynamic row count
    assert chunked_counters()["rewritten"] == 2  # per compile
    s = fx_passes.summary()
    assert (s["regions_rewritten"], s["regions_declined"]) == (1, 0)
    assert s["rewritten"][0]["compiles"] == 2
    assert s["estimated_bytes_avoided"] == 4 * 8 * 64  # the static compile's size
    text = fx_passes.summary_text()
    assert "1 region rewritten" in text and "(x2 compiles)" in text



def entropy_at_a_float_temperature(hidden, weight, t):
    p = ((hidden @ weight.T).float() / t).softmax(-1)
    return -(p * p.log()).sum(-1)


@pytest.mark.parametrize("way", ["backend", "install"])
def test_a_compile_dynamo_restarts_is_counted_once(way, monkeypatch):
    """NOTE [a restarted compile]: under ``dynamic=True`` Inductor specializes the float
    ``t`` by restarting Dynamo's analysis after the passes ran; the abandoned attempt's
    rewrite is taken back (it was counted twice, "x2 compiles").  Twice, with
    ``torch._dynamo.reset()`` between (compile ids start over; the property tests do so)."""
    attempts = []
    real = Session.start_attempt
    monkeypatch.setattr(Session, "start_attempt", lambda self, compile, attempt, counts: (
        attempts.append(attempt), real(self, compile, attempt, counts))[1])
    args = torch.randn(4, 8).bfloat16(), torch.randn(16, 8).bfloat16(), 0.7
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            if way == "backend":
                torch.compile(entropy_at_a_float_temperature, backend="chunked_logits", dynamic=True)(*args)
            else:
                with fx_passes.install():
                    torch.compile(entropy_at_a_float_temperature, dynamic=True)(*args)
        assert chunked_counters() == {"rewritten": 1, "row_local": 1, "row_local_lm_head": 1}
    assert attempts == [0, 1, 0, 1]  # (the restarts reached the passes: else this tests nothing)
    s = fx_passes.summary()
    assert s["regions_rewritten"] == 1 and s["rewritten"][0]["compiles"] == 2 and s["graphs_compiled"] == 2

def test_two_calls_in_one_graph_are_two_regions():
    a, tokens = data()
    torch.compile(two_logprobs, backend="chunked_logits")(a, a.clone(), tokens)
    s = fx_passes.summary()
    assert s["regions_rewritten"] == 2 and s["estimated_bytes_avoided"] == 2 * 4 * 8 * 64


def test_cross_entropy_on_given_logits_avoids_nothing_stock_keeps():
    """Stock Inductor keeps no FP32 [T, V] for a cross-entropy on given logits either."""
    torch.compile(ce, backend="chunked_logits")(*data())
    s = fx_passes.summary()
    assert s["regions_rewritten"] == 1 and s["estimated_bytes_avoided"] == 0
    assert s["rewritten"][0]["bytes_avoided"] == 0


def test_near_miss_is_recorded_once_and_summarised(caplog):
    with caplog.at_level(logging.WARNING, logger="fx_passes"):
        for _ in range(2):
            record_near_miss("f.py:3", "compute the loss inside the compiled function")
        record_near_miss("f.py:9", "set upgrade_low_precision=True")
    assert chunked_counters() == {"near_miss": 2}
    assert [r.getMessage() for r in caplog.records] == [
        "chunked_logits: near miss at f.py:3: compute the loss inside the compiled function",
        "chunked_logits: near miss at f.py:9: set upgrade_low_precision=True"]
    s = fx_passes.summary()
    assert s["near_misses"] == [
        {"where": "f.py:3", "message": "compute the loss inside the compiled function"},
        {"where": "f.py:9", "message": "set upgrade_low_precision=True"}]
    text = fx_passes.summary_text()
    assert "2 near misses" in text and "near miss     at f.py:9" in text


def test_report_only_with_the_backend_says_what_it_would_do(caplog):
    with caplog.at_level(logging.WARNING, logger="fx_passes"):
        out = torch.compile(logprob, backend="chunked_logits", options={"report_only": True})(*data())
    assert out.dtype == torch.float32
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and said[0].startswith("chunked_logits: would rewrite logprob over (8, 64)")
    s = fx_passes.summary()
    assert (s["regions_rewritten"], s["regions_would_rewrite"]) == (0, 1)


def test_summary_keys_and_text_match_the_exit_summary():
    torch.compile(logprob, backend="chunked_logits")(*data())
    s = fx_passes.summary()
    assert sorted(s) == sorted([
        "regions_rewritten", "regions_would_rewrite", "regions_left_to_stock", "regions_declined",
        "declined_by_reason", "near_misses", "estimated_bytes_avoided", "rows_seen", "rows_skipped",
        "masked_rows_not_skipped", "rewritten", "would_rewrite", "left_to_stock", "declined",
        "graphs_compiled", "pass_failed", "installed", "disabled", "counters"])
    assert sorted(s["rewritten"][0]) == ["bytes_avoided", "compiles", "what", "where"]
    assert s["graphs_compiled"] == 1 and s["counters"] == {"rewritten": 1}
    assert fx_passes.summary_text() == exit_summary.format_text(exit_summary.collect())


def test_declined_by_reason():
    def fp32_logits(x, tok):
        return torch.log_softmax(x.float(), -1).gather(-1, tok[:, None])
    x, tok = data()
    torch.compile(fp32_logits, backend="chunked_logits")(x.float(), tok)
    s = fx_passes.summary()
    assert s["regions_declined"] == 1 and s["declined_by_reason"] == {"NOT_LOW_PRECISION": 1}
    assert s["declined"][0]["reason"] == "NOT_LOW_PRECISION"


def test_summary_imports_no_torch():
    code = ("import sys, fx_passes; s = fx_passes.summary(); "
            "print(s['regions_rewritten'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(),
                         timeout=120)
    assert out.stdout.split() == ["0", "False"], out.stderr


def test_fused_lm_head_counts_the_logits_it_never_makes():
    """logits = h @ w.T fused into the loop: the FP32 [T, V] and the bf16 [T, V] logits."""
    def head_logprob(h, w, tokens):
        return logprob(h @ w.T, tokens)

    h, w, tokens = torch.randn(8, 16).bfloat16(), torch.randn(64, 16).bfloat16(), torch.randint(0, 64, (8,))
    torch.compile(head_logprob, backend="chunked_logits")(h, w, tokens)
    assert chunked_counters().get("lm_head_fused") == 1
    assert fx_passes.summary()["estimated_bytes_avoided"] == 4 * 8 * 64 + 2 * 8 * 64
