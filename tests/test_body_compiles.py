"""How the chunk bodies are compiled (``fx_passes/kernels/ops/body_compiler.py``): the user's
Inductor settings reach them (but CUDA graphs and custom passes); a body past Dynamo's
recompile limit falls back to eager, counted and said once; a body never compiles
inside a CUDA graph capture (checked with the capture query patched: CPU torch has none)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from fx_passes import compat
from fx_passes.kernels.ops import body_compiler
from fx_passes.reporting.report import COUNTER
from tests.cases import lm_logprob_entropy


@pytest.fixture(autouse=True)
def _clean():
    counters.clear()
    saved = body_compiler.user_options()
    yield
    body_compiler.use_user_options(saved)


def test_user_inductor_options_reach_the_bodies(monkeypatch):
    """``torch.compile(backend="chunked_logits", options={"inductor": ...})``: the lm_head
    loop's bodies are made with the user's settings plus their own, without CUDA graphs
    or the user's custom passes.  (The rewritten graph runs as is: Inductor's compile of
    the user's graph is not what is looked at.)"""
    import torch._inductor.compile_fx as compile_fx

    monkeypatch.setattr(compile_fx, "compile_fx", lambda gm, example_inputs, config_patches=None: gm)
    seen = []

    def recording(fn, options):
        seen.append(dict(options or {}))
        return fn  # (eager bodies: only the settings are looked at)

    torch.manual_seed(0)
    hidden = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(256, 32, dtype=torch.bfloat16, requires_grad=True)
    tok, adv = torch.randint(0, 256, (64,)), torch.randn(64)
    user = {"coordinate_descent_tuning": True, "triton.cudagraphs": True, "post_grad_custom_post_pass": None}
    with body_compiler.compiling_with(recording):
        step = torch.compile(lm_logprob_entropy, backend="chunked_logits", fullgraph=True,
                             options={"chunk_budget_mib": 1, "inductor": user})
        step(hidden, weight, tok, adv).backward()
    assert counters[COUNTER]["lm_head_fused"] >= 1, dict(counters[COUNTER])
    assert seen, "no chunk body was made"
    for options in seen:
        assert options.get("coordinate_descent_tuning") is True, options
        assert not any("cudagraph" in k or "custom" in k for k in options), options
    assert any(options.get("emulate_precision_casts") is True for options in seen)  # (a body's own)


def test_mode_settings_for_bodies():
    """``mode="max-autotune"``'s settings, as the backend passes them on: the tuning ones
    kept, its CUDA graphs dropped."""
    from fx_passes.entry.backend import settings

    _, inductor = settings({}, "max-autotune")
    body_compiler.use_user_options(inductor)
    assert body_compiler.user_options() == {"max_autotune": True, "coordinate_descent_tuning": True}


def _double(x):
    return x * 2


def test_recompile_limit_is_counted_and_said_once(caplog):
    """A body that would recompile past ``torch._dynamo.config.recompile_limit`` runs
    eagerly from then on: counted (``body_recompile_limit`` and the body's counter), one
    log line (before: only the generic compile-failure line, no such counter)."""
    assert hasattr(torch._dynamo.config, "recompile_limit")
    body = body_compiler.compile_body(("test", "recompile_limit"), _double, "test_double", "test_body_eager")
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level(logging.WARNING, "fx_passes"):
        x = torch.arange(6.0).reshape(2, 3)
        torch.testing.assert_close(body(x), x * 2)  # compiled (one entry)
        for dtype in (torch.float64, torch.float16, torch.int32):  # a dtype guard fails: a recompile
            y = x.to(dtype)
            torch.testing.assert_close(body(y), y * 2)
    c = counters[COUNTER]
    assert c["body_recompile_limit"] == 1 and c["test_body_eager"] == 1, dict(c)
    said = [r for r in caplog.records if "recompile limit" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


def test_no_compile_inside_a_capture(monkeypatch, caplog):
    """A body first called while the stream captures runs eagerly (counted, said once)
    and compiles at its first call outside the capture."""
    made = []

    def compiled_marker(fn, options):
        def run(*args):
            made.append(args[0].shape)
            return fn(*args)
        return run

    with body_compiler.compiling_with(compiled_marker):
        body = body_compiler.compile_body(("test", "capture"), _double, "test_double_capture",
                                          "test_body_eager")
    x = torch.ones(3)
    monkeypatch.setattr(compat, "_capturing", lambda kind: True)
    with caplog.at_level(logging.WARNING, "fx_passes"):
        torch.testing.assert_close(body(x), x * 2)
        torch.testing.assert_close(body(x), x * 2)
    assert made == [] and counters[COUNTER]["body_in_capture_eager"] == 2
    assert len([r for r in caplog.records if "capture" in r.getMessage()]) == 1
    monkeypatch.setattr(compat, "_capturing", lambda kind: False)
    body(x)
    monkeypatch.setattr(compat, "_capturing", lambda kind: True)
    body(x)  # (warm: its compiled kernels run, also inside a capture)
    assert made == [x.shape, x.shape] and counters[COUNTER]["body_in_capture_eager"] == 2
