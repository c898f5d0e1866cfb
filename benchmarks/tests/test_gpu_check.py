"""The GPU check's plumbing on the CPU: what CI can run of benchmarks/gpu_check.py.

A test of the benchmark scripts themselves, so it lives with them (tests/ imports no
benchmark); ``make test`` runs it (pyproject's ``testpaths``).

The whole ``--dry-run`` takes about 2 minutes on 2 cores with a warm Inductor cache
(docs/gpu.md), so the test runs a subset in one fresh process: ``--cases WV,VP`` (the
fused lm_head with the loss in the graph on the forced ``gpu`` plan, and the vocab-parallel
step on a one-rank group), with the GPU tests (all skipped without CUDA); every phase,
the JSON and the Markdown.  The other cases run the same phases (docs/gpu.md says how to
run them all).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from benchmarks import gpu_case, gpu_check, gpu_report
from benchmarks.gpu_check import CASE_NAMES, DRY_T
from fx_passes.env import without_ours as clean_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
SUBSET = ("WV", "VP")
# The masked cases check counters, host reads and errors, never a time: one timing round and
# no warm-up steps (the compiling step, the memory, sync, profile and GEMM phases run as before)
COUNTS_ONLY = ("--device", "cpu", "--dry-run", "--steps", "1", "--warmup", "0")


def _strict_json(path: pathlib.Path):
    def refuse(constant):
        raise AssertionError(f"{path.name} is not strict JSON: {constant}")
    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """(output folder, stdout, JSON, Markdown) of one dry run of ``SUBSET`` in a fresh process;
    guards wide enough for a loaded CI machine (the guards' own test is the budget's below)."""
    out = tmp_path_factory.mktemp("gpu_check")
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(out),
           "--cases", ",".join(SUBSET), "--case-guard", "240", "--budget", "540"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout, _strict_json(out / "gpu_check.json"), (out / "gpu_check.md").read_text()


@pytest.mark.slow
def test_every_mode_of_the_subset_is_measured(dry_run):
    out, _, summary, page = dry_run
    rows = {(r["case"], r["mode"]): r for r in summary["rows"]}
    assert set(rows) == {(c, m) for c in SUBSET for m in gpu_case.modes_of(c, True)}
    for (c, m), r in rows.items():
        assert f"| {c} | {m} |" in page
        assert "error" not in r, r
        if c != "VP":  # (the GEMM recording fails on the vocab-parallel op: a line, and the profiler's count)
            assert not r.get("check_errors"), r
        assert r["peak_mib"] >= 0 and r["t_median_ms"] > 0 and r["out_err"] < 1e-3, r
        assert r["n_time_steps"] == 2 and r["t_ratio_vs_stock"] > 0
        assert r["kernels"] > 0 and r["gemm_ms"] >= 0 and isinstance(r["syncs"], list), r
        assert r["sync_mode"] == "n/a (CPU)"
        assert r["span_ms"] >= r["busy_ms"] > 0 and r["idle_ms"] >= 0, r  # (the timeline's stand-in)
        assert f"| {c} | {m} | {r['span_ms']:.2f} | {r['busy_ms']:.2f} |" in page
        if m != "inductor":
            assert r["chunked_logits"]["rewritten"] == 1, r
        assert (out / "cases" / f"{c}_{DRY_T}.json").exists()
    # the forced gpu plan computes the loss's gradients in the forward; the model's row beside it
    assert rows[("WV", "ours:gpu")]["chunked_logits"]["gradients_in_forward"] == 1
    assert rows[("WV", "ours:gpu")]["predicted"]["ratio"] > 0 < rows[("VP", "ours")]["predicted"]["ratio"]
    assert rows[("WV", "inductor")]["gemm_tflops"] > 0
    assert rows[("VP", "ours")]["chunked_logits"]["vocab_parallel"] == 1
    assert summary["meta"]["dry_run"] and summary["complete"] and summary["meta"]["seconds"] > 0
    outcomes = summary["tests"]["outcomes"]
    assert outcomes["SKIPPED"] > 0 and outcomes["PASSED"] == outcomes["FAILED"] == outcomes["ERROR"] == 0
    assert "skipped" in summary["tests"]["summary"]  # pytest -m gpu ran, and skipped without CUDA


def test_budget_skips_the_rest_with_a_line(tmp_path, capsys):
    assert gpu_check.main(["--dry-run", "--skip-tests", "--budget", "1", "--out", str(tmp_path)]) == 0
    names = ", ".join(f"{c} (T {DRY_T})" for c in CASE_NAMES)
    assert f"budget (1 s) spent: {names} skipped" in capsys.readouterr().out
    summary = _strict_json(tmp_path / "gpu_check.json")
    assert summary["rows"] == [] and summary["complete"]


def test_case_guard_skips_the_remaining_phases(tmp_path):
    gpu_case.main(["WV:16:64:16:0", "--out", str(tmp_path), "--device", "cpu", "--dry-run"])
    result = _strict_json(tmp_path / "cases" / "WV_16.json")
    assert result["notes"] == ["time guard (0 s) reached: compile and later phases skipped"]
    assert list(result["rows"]) == list(gpu_case.modes_of("WV", True))
    assert all(set(r) == {"predicted"} for r in result["rows"].values())


def test_the_timeline_splits_the_span():
    """A profiled step's device time: overlapping kernels count once in ``busy_ms``, the
    gaps are ``idle_ms``, and each kernel falls in one class (GEMM, memset / copy, other)."""
    kernels = [("nvjet_tst_gemm", 0.0, 10_000.0), ("triton_red_fused_0", 12_000.0, 15_000.0),
               ("Memset (Device)", 14_000.0, 18_000.0), ("triton_red_fused_0", 15_000.0, 16_000.0),
               ("triton_poi_fused_1", 20_000.0, 21_000.0)]
    t = gpu_case.timeline(kernels, lambda n: "gemm" in n)
    assert (t["span_ms"], t["busy_ms"], t["idle_ms"]) == (21.0, 17.0, 4.0)
    assert (t["gemm_ms"], t["copy_ms"], t["other_ms"]) == (10.0, 4.0, 5.0)
    assert t["top_kernels"] == [["triton_red_fused_0", 2, 4.0], ["triton_poi_fused_1", 1, 1.0]]
    assert gpu_case.timeline([], lambda n: True) == {}


def test_a_killed_test_run_still_counts_what_finished():
    log = ("tests/test_gpu.py::test_a[x] PASSED  [ 10%]\ntests/test_gpu.py::test_b FAILED  [ 20%]\n"
           "tests/test_gpu.py::test_c SKIPPED (needs a CUDA GPU)  [ 30%]\n")
    assert gpu_check.outcomes_of(log) == {"PASSED": 1, "FAILED": 1, "SKIPPED": 1, "ERROR": 0}


def test_the_gpu_plan_order():
    """Stock first (the ratios' base), then the lm_head plans a GPU runs; the GPU's sizes."""
    assert gpu_case.CASES["W4L"].modes == ("inductor", "ours:gpu", "ours:blocks", "ours:two_sweeps",
                                           "ours:kept_logits")
    assert [c[:4] for c in gpu_check.PLAN[:2]] == [("W4L", 8192, 151936, 4096), ("WV", 8192, 151936, 4096)]


def test_a_child_past_its_time_is_killed():
    rc, _ = gpu_check.run_child([sys.executable, "-c", "import time; time.sleep(60)"], 1, clean_env())
    assert rc is None


def test_the_masked_case_skips_rows_with_one_read(tmp_path):
    """W4C (half the labels -100): ours runs the rows that count after one host read, the
    same step with the option off reads nothing and runs every row, in one process."""
    T = 128
    gpu_case.main([f"W4C:{T}:600:64:240", *COUNTS_ONLY, "--out", str(tmp_path)])
    result = _strict_json(tmp_path / "cases" / f"W4C_{T}.json")
    rows = result["rows"]
    assert list(rows) == ["inductor", "ours", "ours:all_rows"], result["notes"]
    ours, every = rows["ours"], rows["ours:all_rows"]
    # (the prompt half, less the count's rounding up to the chunk granule, plus WV's 10% ignored)
    assert T // 4 < ours["chunked_logits"]["rows_skipped"] < T
    assert "rows_skipped" not in every["chunked_logits"]
    assert ours["syncs"] and not every["syncs"], (ours["syncs"], every["syncs"])
    assert ours["predicted"]["ratio"] > 0 and every["predicted"]["ratio"] > 0
    # at the plan's size the cost model prices half the rows below every row, read included
    # (at the dry run's the 100 us read is most of the step); calibrated on the H200 run,
    # which measured 0.70x and 1.17x with the loss loop's 4 row chunks (docs/gpu.md, "Where
    # the time goes").  As built, a cross-entropy's FP32 sums at T 8192 = 2 H would peak over
    # stock's, so the per-token call runs it (one GEMM more): 0.82x and 1.43x; at T 16384 the
    # loss loop (2 chunks, the gradient over the logits): 0.57x and 1.03x
    full = {t: [gpu_case.predicted("W4C", m, t, gpu_check.FULL_V, gpu_check.FULL_H)["ratio"]
                for m in ("ours", "ours:all_rows")] for t in (8192, 16384)}
    assert 0.75 < full[8192][0] < 0.85 and 1.4 < full[8192][1] < 1.45, full
    assert 0.5 < full[16384][0] < 0.6 and 1.0 < full[16384][1] < 1.1, full
    for row in rows.values():  # the same error as stock's (pass_report: vs FP64)
        assert "check_errors" not in row, row


@pytest.mark.full
def test_the_masked_row_local_case_reads_once(tmp_path):
    """WDM (WD's KL as a masked mean, half the rows masked): row_local_loss skips them with
    one read a step (its forward's; the gpu plan's backward reads nothing), the option off
    reads nothing; the same errors."""
    T = 128
    gpu_case.main([f"WDM:{T}:600:64:240", *COUNTS_ONLY, "--out", str(tmp_path)])
    rows = _strict_json(tmp_path / "cases" / f"WDM_{T}.json")["rows"]
    assert list(rows) == ["inductor", "ours", "ours:all_rows"], rows
    ours, every = rows["ours"], rows["ours:all_rows"]
    assert ours["chunked_logits"]["masked_rows"] == 1 and ours["chunked_logits"]["rows_skipped"] == T // 2
    assert "rows_skipped" not in every["chunked_logits"] and not every["syncs"], every
    assert ours["syncs"] == ["aten::_local_scalar_dense", "aten::item"], ours["syncs"]  # (one read)
    for row in rows.values():
        assert "check_errors" not in row and "error" not in row, row


@pytest.mark.full
def test_the_masked_per_token_case_reads_once(tmp_path):
    """W4E (a masked policy loss and its masked-mean entropy metric leave the graph, half the
    rows masked): the per-token path's masked call skips them with one read (its forward's;
    the backward reads a host tensor), the option off reads nothing; the same errors."""
    T = 128
    gpu_case.main([f"W4E:{T}:600:64:240", *COUNTS_ONLY, "--out", str(tmp_path)])
    rows = _strict_json(tmp_path / "cases" / f"W4E_{T}.json")["rows"]
    assert list(rows) == ["inductor", "ours", "ours:all_rows"], rows
    ours, every = rows["ours"], rows["ours:all_rows"]
    assert ours["chunked_logits"]["masked_rows"] == 1 and ours["chunked_logits"]["rows_skipped"] == T // 2
    assert "rows_skipped" not in every["chunked_logits"] and not every["syncs"], every
    assert ours["syncs"] == ["aten::_local_scalar_dense", "aten::item"], ours["syncs"]
    for row in rows.values():
        assert "check_errors" not in row and "error" not in row, row


def test_runs_merge_into_one_table(tmp_path):
    """docs/gpu.md's Results table: a later run's row replaces an earlier one's, each
    row's peak is set over its case's stock row, and an unmeasured peak (a CUDA-graph
    replay: ~0 MiB) gives no ratio."""
    def row(case, mode, peak, ratio, sync="ok"):
        return {"case": case, "mode": mode, "T": 8, "V": 16, "H": 4, "peak_mib": peak,
                "t_median_ms": 1.0, "t_ratio_vs_stock": ratio, "sync_mode": sync}
    first, second = tmp_path / "run1.json", tmp_path / "run2.json"
    first.write_text(json.dumps({"rows": [row("A", "inductor", 100.0, 1.0), row("A", "ours:gpu", 80.0, 1.5,
                                                                               "SYNC: first only"),
                                          row("R", "inductor:ro", 0.0, 1.0), row("R", "ours:ro", 0.0, 1.2)]}))
    second.write_text(json.dumps({"rows": [row("A", "ours:gpu", 50.0, 1.1,
                                                "SYNC x1: fx_passes/kernels/rows.py:69 select")]}))
    rows = {(r["case"], r["mode"]): r for r in gpu_report.merged([first, second])}
    assert rows["A", "ours:gpu"]["run"] == "run2" and rows["A", "ours:gpu"]["peak_vs_stock"] == 0.5
    assert rows["A", "inductor"]["peak_vs_stock"] == 1.0 and rows["R", "ours:ro"]["peak_vs_stock"] is None
    table = gpu_report.summary_table([first, second])
    assert ("| A | 8 | ours:gpu | 50 | 0.50 | 1.0 | 1.10 | - | SYNC x1: kernels/rows.py:69 select | run2 |"
            in table)
    assert "| R | 8 | ours:ro | 0 | - |" in table and "first only" not in table
