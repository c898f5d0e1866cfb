"""The examples, unmodified, in fresh processes: the launcher, the environment switch
and the backend each make the pass fire on them, and results match runs without it.

Two runs that a test compares go in parallel (the machine has 2 cores).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import clean_env, last_json
from tests.numerics import FULL_MATRIX

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BIN = pathlib.Path(sys.executable).parent
LAUNCHER = [str(BIN / "chunked-logits"), "run"]

pytestmark = pytest.mark.slow


def offline_env(**extra: str) -> dict:
    return clean_env(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **extra)


def run(cmd: list[str], cwd, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=offline_env(**env), timeout=600)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def parallel(*jobs):
    with ThreadPoolExecutor(len(jobs)) as pool:
        return [f.result() for f in [pool.submit(*job) for job in jobs]]


def test_sft_hf_trainer_under_the_launcher(tmp_path):
    """Trainer(torch_compile=True) -> backend "inductor": the launcher rewrites
    ForCausalLMLoss's logits.float() + cross_entropy; losses match a run without it."""
    # 2 steps (the example's default is 4): the second runs the compiled graph again on the
    # weights the first step's update left, all that a longer run would add here
    script = [str(EXAMPLES / "sft_hf_trainer.py"), "--steps", "2"]
    summary = tmp_path / "summary.json"
    with_pass, stock = parallel(
        (run, [*LAUNCHER, "--summary-json", str(summary), "--", *script], tmp_path),
        (run, [sys.executable, *script], tmp_path),
    )
    data = json.loads(summary.read_text())
    assert data["counters"]["rewritten"] == 1 and "pass_failed" not in data["counters"]
    (event,) = [e for e in data["events"] if e["kind"] == "rewritten"]
    assert event["what"].startswith("loss over (128, 2048)")
    assert "ForCausalLMLoss" in event["where"] and "loss_utils.py" in event["where"]
    assert event["fp32_bytes_avoided"] == 0  # a cross-entropy alone: stock keeps no FP32 [T, V] either
    assert "chunked_logits summary" in with_pass.stderr and "ForCausalLMLoss" in with_pass.stderr
    ours, theirs = last_json(with_pass.stdout), last_json(stock.stdout)
    assert ours["backend"] == theirs["backend"] == "inductor"
    assert len(ours["losses"]) == 2
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-3)
    assert "chunked_logits" not in stock.stderr


def test_grpo_step_backend_and_launcher(tmp_path):
    """The same unmodified step: backend="chunked_logits" by name, and stock "inductor"
    under the launcher; both rewrite the region.  Every step is measured from the same
    weights in every run (the script steps along the FP64 gradient), so each run's error
    against FP64 is held to stock Inductor's at the same weights, on any CPU."""
    script = [str(EXAMPLES / "grpo_step.py"), "--steps", "2"]  # (was 3) one step after an update
    # (the launcher's run is make test-full's: make test takes the launcher through the SFT run above)
    jobs = [(run, [sys.executable, *script, "--backend", "chunked_logits"], tmp_path),
            (run, [sys.executable, *script], tmp_path)]
    if FULL_MATRIX:
        jobs.append((run, [*LAUNCHER, "--", *script], tmp_path))
    backend, stock, *launched = parallel(*jobs)
    a, s, *b = (last_json(p.stdout) for p in (backend, stock, *launched))
    assert a["backend"] == "chunked_logits" and s["backend"] == "inductor"
    assert s["counters"] == {}
    for r in (a, *b):
        assert r["counters"]["rewritten"] == 1 and "pass_failed" not in r["counters"]
        for ours, theirs in zip(r["steps"], s["steps"], strict=True):
            assert ours["loss_fp64"] == pytest.approx(theirs["loss_fp64"], rel=1e-9)  # same weights
            stock_loss_err = abs(theirs["loss"] - theirs["loss_fp64"])
            assert abs(ours["loss"] - ours["loss_fp64"]) <= 1.25 * stock_loss_err + 1e-6
            assert ours["grad_err"] <= 1.25 * theirs["grad_err"] + 1e-6 * ours["grad_scale"]
    assert "chunked_logits summary" not in backend.stderr  # no launcher, no summary
    for r, p in zip(b, launched):  # stock Inductor under the launcher: the same rewrite
        assert r["backend"] == "inductor"
        assert [x["loss"] for x in a["steps"]] == pytest.approx([x["loss"] for x in r["steps"]],
                                                               rel=1e-5, abs=1e-7)
        assert "logprob+neg_entropy over (8, 31, 2048)" in p.stderr
        assert "temperature moved after the upcast" in p.stderr


@pytest.mark.full
def test_ref_scoring_under_the_environment_switch(tmp_path):
    """CHUNKED_LOGITS=1, no launcher, no code change: the no_grad scoring is rewritten.
    (Under make's AVX2 emulation the model's attention is eager: SDPA's bf16 CPU flash
    kernel packs with VNNI, which ATen refuses once its capability is forced down to
    AVX2 on an AVX-512 machine, whatever the pass does; transformers 5.24 picks it.)"""
    emulated = os.environ.get("ATEN_CPU_CAPABILITY") == "avx2"
    attention = "eager" if emulated else "sdpa"
    proc = run([sys.executable, str(EXAMPLES / "ref_scoring.py"), "--attention", attention], tmp_path,
               CHUNKED_LOGITS="1")
    out = last_json(proc.stdout)
    assert out["counters"]["rewritten"] == 1 and "pass_failed" not in out["counters"]
    assert out["shape"] == [8, 63] and out["dtype"] == "torch.float32"
    assert out["max_diff_vs_eager"] < 1e-2  # Inductor's bf16 model math, the same as stock
    assert out["max_err_vs_fp64"] <= out["max_diff_vs_eager"] + 1e-3
    assert "chunked_logits summary" in proc.stderr and "logprob over (8, 63, 4096)" in proc.stderr


def test_demo_small(tmp_path):
    """The README's demo at a smaller size: less memory, the same error, a report."""
    proc = run([sys.executable, str(EXAMPLES / "demo.py"), "--tokens", "1024", "--vocab", "8192",
                "--steps", "1", "--json"], tmp_path)
    results = last_json(proc.stdout)
    stock, ours = results["inductor"], results["chunked_logits"]
    assert ours["counters"]["rewritten"] == 1
    fp32 = 4 * 1024 * 8192
    assert stock["extra_bytes"] >= fp32  # stock materialises at least one FP32 [T, V]
    assert ours["extra_bytes"] < stock["extra_bytes"] - fp32 // 2
    assert ours["max_err"] <= 2 * stock["max_err"] + 1e-6
    assert ours["loss"] == pytest.approx(stock["loss"], rel=1e-3, abs=1e-4)
    assert "peak extra memory of one step" in proc.stdout and "1 region rewritten" in proc.stdout
    # the time: both backends in one process, interleaved, the median of --steps each
    assert stock["n_steps"] == ours["n_steps"] == 1 and results["time_ratio"] > 0
    assert "step time, chunked_logits vs stock" in proc.stdout and "(lower is better)" in proc.stdout


@pytest.mark.full
def test_demo_padded(tmp_path):
    """``--padding``: the step's loss and entropy averaged over a completion mask; the pass
    leaves the padding rows out of its loop (rows that count), with the same loss and error."""
    proc = run([sys.executable, str(EXAMPLES / "demo.py"), "--tokens", "1024", "--vocab", "8192",
                "--steps", "1", "--padding", "0.5", "--json"], tmp_path)
    results = last_json(proc.stdout)
    stock, ours = results["inductor"], results["chunked_logits"]
    c = ours["counters"]
    assert c["masked_rows"] == 1 and 0 < c["rows_skipped"] <= c["rows_seen"] // 2, c
    assert ours["max_err"] <= 2 * stock["max_err"] + 1e-6
    assert ours["loss"] == pytest.approx(stock["loss"], rel=1e-3, abs=1e-4)
    assert "the last 50% of the rows padding" in proc.stdout and "rows skipped:" in proc.stdout


# (the launcher on a Trainer: test_sft_hf_trainer_under_the_launcher; TRL's trainers: the GRPO run below)
@pytest.mark.full
def test_trl_sft_under_the_launcher(tmp_path):
    """TRL's SFTTrainer, unmodified, torch_compile=True: TRL trains through its own fused
    lm_head (FP32 per vocabulary tile, no [T, V] logits), so the launcher finds nothing to
    rewrite; it only drops TRL's multiplications by 1.0, and every logged number is stock's."""
    pytest.importorskip("trl")
    script = str(EXAMPLES / "trl_sft.py")
    summary = tmp_path / "summary.json"
    with_pass, stock = parallel(
        (run, [*LAUNCHER, "--summary-json", str(summary), "--", script], tmp_path),
        (run, [sys.executable, script], tmp_path),
    )
    counters = json.loads(summary.read_text())["counters"]
    assert "rewritten" not in counters and "pass_failed" not in counters and "declined" not in counters
    assert "no FP32 upcast of bf16/fp16 logits" in with_pass.stderr
    ours, theirs = last_json(with_pass.stdout), last_json(stock.stdout)
    assert len(ours["losses"]) == 2
    for key in ("losses", "entropy", "grad_norm"):
        assert ours[key] == theirs[key], key


@pytest.mark.full
def test_trl_grpo_with_the_upgrade_by_environment(tmp_path):
    """TRL's GRPOTrainer (generation by the model itself), with CHUNKED_LOGITS=1 and
    upgrade_low_precision: TRL's policy log-probs come from its fused lm_head, not from a
    bf16 log_softmax in the compiled graph, so even the upgrade has nothing to take."""
    pytest.importorskip("trl")
    script = str(EXAMPLES / "trl_grpo.py")
    switch = functools.partial(run, CHUNKED_LOGITS="1", CHUNKED_LOGITS_OPTIONS="upgrade_low_precision")
    with_pass, stock = parallel(
        (switch, [sys.executable, script], tmp_path),
        (run, [sys.executable, script], tmp_path),
    )
    ours, theirs = last_json(with_pass.stdout), last_json(stock.stdout)
    assert "rewritten" not in ours["counters"] and "pass_failed" not in ours["counters"]
    assert "chunked_logits summary" in with_pass.stderr and "chunked_logits" not in stock.stderr
    assert len(ours["reward"]) == 2 and ours["reward"][0] > 0
    for key in ("losses", "entropy", "grad_norm", "reward"):
        assert ours[key] == theirs[key], key
