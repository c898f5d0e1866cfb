"""The GPU check's plumbing on the CPU: what CI can run of benchmarks/gpu_check.py.

A test of the benchmark scripts themselves, so it lives with them (tests/ imports no
benchmark); ``make test`` runs it (pyproject's ``testpaths``).

``--dry-run`` runs every workload and mode at tiny sizes with the CPU stand-ins, saves
and checks the generated code, and writes the JSON and the Markdown; the real check
needs a CUDA GPU (docs/gpu.md).  The dry run's sizes are tests/test_codegen.py's, so
in a whole test run most of its graphs come from Inductor's cache.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from benchmarks import gpu_case, gpu_check
from benchmarks.gpu_check import DRY_T, DRY_V, WORKLOADS
from fx_passes.env import without_ours as clean_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASELINES = ("liger", "cce")


def _strict_json(path: pathlib.Path):
    def refuse(constant):
        raise AssertionError(f"{path.name} is not strict JSON: {constant}")
    return json.loads(path.read_text(), parse_constant=refuse)


def _gpu_check(out: pathlib.Path, *args: str) -> str:
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--out", str(out), *args]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """(output folder, stdout, JSON, Markdown) of one dry run in a fresh process."""
    out = tmp_path_factory.mktemp("gpu_check")
    stdout = _gpu_check(out, "--dry-run")
    return out, stdout, _strict_json(out / "gpu_check.json"), (out / "gpu_check.md").read_text()


@pytest.mark.slow
def test_every_workload_and_mode_is_measured(dry_run):
    _, stdout, summary, page = dry_run
    rows = {(r["workload"], r["mode"]): r for r in summary["rows"]}
    assert set(rows) == {(w, m) for w in WORKLOADS for m in gpu_case.modes_for(w)}
    for (w, m), r in rows.items():
        assert f"| {w} | {m} |" in page
        if m in BASELINES:  # neither is installed on the CPU machines (nor usable without CUDA)
            assert f"{w}: {m} skipped: " in stdout and r["skipped"]
            continue
        assert "error" not in r, r
        assert r["peak_mib"] >= 0 and r["t_median_ms"] > 0 and r["out_err"] < 1e-3, r
        assert r["n_time_steps"] == 2 and r["t_ratio_vs_stock"] > 0
        if m != "inductor":
            assert r["chunked_logits"]["rewritten"] == 1, r
    assert summary["meta"]["dry_run"] and "torch" in summary["meta"] and summary["meta"]["date"]
    assert "11 skipped" in summary["tests"]["summary"]  # pytest -m gpu ran, and skipped without CUDA
    assert {t["target"] for t in summary["targets"]} >= {"peak/limit <= 1.15", "peak/limit <= 1.5",
                                                        "peak <= 64 MiB", "time vs stock <= 1.0"}


@pytest.mark.slow
def test_generated_code_is_saved_and_checked(dry_run):
    out, _, summary, _ = dry_run
    codegen = {(c["workload"], m): g for c in summary["cases"] for m, g in c["codegen"].items()}
    assert set(codegen) == {(w, m) for w in gpu_case.CODE_WORKLOADS for m in gpu_case.COMPILED}
    for (w, m), g in codegen.items():
        assert g["files"] and all((out / f).read_text() for f in g["files"])
        if m != "inductor":
            assert g["flagged"] == [], (w, m)
    # the positive control: stock Inductor's W3 keeps an FP32 [T, V] buffer, and the check sees it
    assert [str(DRY_T), str(DRY_V)] in codegen[("W3", "inductor")]["flagged"]


def test_budget_skips_the_rest_with_a_line(tmp_path, capsys):
    assert gpu_check.main(["--dry-run", "--skip-tests", "--budget", "1", "--out", str(tmp_path)]) == 0
    assert f"budget (1 s) spent: {', '.join(WORKLOADS)} skipped" in capsys.readouterr().out
    assert _strict_json(tmp_path / "gpu_check.json")["rows"] == []


def test_case_guard_skips_the_remaining_phases(tmp_path):
    gpu_case.main(["W1:16:64", "--out", str(tmp_path), "--device", "cpu", "--guard", "0"])
    result = _strict_json(tmp_path / "cases" / "W1.json")
    assert result["notes"] == ["time guard (0 s) reached: compile and later phases skipped"]
    assert set(result["rows"]) == set(gpu_case.modes_for("W1")) and not any(result["rows"].values())


def test_a_child_past_its_time_is_killed():
    rc, _ = gpu_check.run_child([sys.executable, "-c", "import time; time.sleep(60)"], 1, clean_env())
    assert rc is None
