"""run.py's peer modes (torch's ``F.linear_cross_entropy``) and its plot, at tiny sizes.

The plumbing only: a peer mode yields a row with a peak, a time ratio to stock and
errors against FP64; a peer that cannot run is one line; ``--plot`` writes a PNG, or
says in one line that matplotlib is missing and still writes the CSV.  No timer
assertions.  The children run in this process (``run.spawn`` replaced) to keep it
to seconds; the real run starts one process per case (benchmarks/README.md).
"""

from __future__ import annotations

import csv
import math
import sys

import pytest
import torch

from benchmarks import baselines, plot, run

T, V = 32, 256  # WV at T 32, V 256 (H 1024: the workload's)
PEERS = ("torch_lce", "torch_lce_compiled")
needs_torch_lce = pytest.mark.skipif(baselines.peer_unavailable() is not None,
                                     reason=str(baselines.peer_unavailable()))


def _in_process(args, extra, env_extra=None, rows=None) -> dict:
    return run.child_result(run.parse_args(run.child_argv(args, extra, rows)))


def _run(tmp_path, *argv: str) -> dict:
    """run.py's parent on WV with ``argv``; the CSV's rows by (T, mode)."""
    out = tmp_path / "results.csv"
    run.main(["--workloads", "WV", "--vocab", str(V), "--rows", str(T), "--csv", str(out), *argv])
    with out.open(newline="") as f:
        return {(int(r["T"]), r["mode"]): r for r in csv.DictReader(f)}


def _number(row: dict, column: str) -> float:
    value = float(row[column])
    assert math.isfinite(value), (column, row)
    return value


@needs_torch_lce
def test_peer_modes_yield_memory_time_ratio_and_error(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "spawn", _in_process)
    rows = _run(tmp_path, "--modes", ",".join(("inductor", *PEERS)), "--steps", "1", "--warmup", "1")
    assert set(rows) == {(T, m) for m in ("inductor", *PEERS)}
    assert _number(rows[(T, "inductor")], "t_ratio_vs_stock") == 1.0
    for mode in PEERS:
        row = rows[(T, mode)]
        assert not row["error"], row["error"]
        assert _number(row, "peak_mib") >= 0
        assert _number(row, "t_ratio_vs_stock") > 0
        # F.linear_cross_entropy returns its loss in bf16: error about 2^-9 of a loss of ~8
        assert 0 <= _number(row, "out_err") < 0.1
        assert 0 <= _number(row, "grad_err") < 0.1


def test_peer_without_linear_cross_entropy_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delattr(torch.nn.functional, "linear_cross_entropy", raising=False)
    rows = _run(tmp_path, "--modes", ",".join(("inductor", *PEERS)), "--skip-memory", "--skip-time")
    lines = capsys.readouterr().out.splitlines()
    for mode in PEERS:
        said = [ln for ln in lines if ln.startswith(f"WV: {mode} skipped: ")]
        assert len(said) == 1 and "has no F.linear_cross_entropy" in said[0], lines
    assert set(rows) == {(T, "inductor")}


def test_peer_on_another_workload_is_skipped(capsys):
    args = run.parse_args(["--workloads", "W1", "--modes", "inductor,torch_lce"])
    assert run.modes_of(args, "W1") == (["inductor"], ["inductor"])
    assert dict(run.skipped_modes(args, "W1")) == {"torch_lce": "computes only WV's loss"}


def _csv(tmp_path) -> str:
    """A run.py CSV of two T values, two modes, written by its own writer."""
    from benchmarks import report
    rows = [{"workload": "WV", "mode": m, "T": t, "V": V, "limit_mib": 1.0, "peak_mib": t * k,
             "t_median_ms": t * k / 10, "t_ratio_vs_stock": k}
            for t in (256, 512) for m, k in (("inductor", 1.0), ("torch_lce", 3.0))]
    path = tmp_path / "results.csv"
    report.write_csv(rows, str(path))
    return str(path)


def test_plot_writes_a_png_next_to_the_csv(tmp_path):
    pytest.importorskip("matplotlib")
    png = plot.write_plot(_csv(tmp_path))
    assert png == tmp_path / "results.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    path = _csv(tmp_path)
    assert plot.write_plot(path) is None
    out = capsys.readouterr().out.splitlines()
    assert out == [plot.MISSING.format(csv=path)]
    assert "matplotlib is not installed" in out[0]
    assert not list(tmp_path.glob("*.png"))


def test_run_plot_without_matplotlib_still_writes_the_csv(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rows = _run(tmp_path, "--modes", "inductor", "--skip-memory", "--skip-time", "--plot")
    assert set(rows) == {(T, "inductor")}
    assert sum("matplotlib is not installed" in ln for ln in capsys.readouterr().out.splitlines()) == 1
    assert not list(tmp_path.glob("*.png"))


def test_the_cpu_clock_reaches_the_timing_child(monkeypatch):
    """``--clock cpu``: the child that times the modes reads the process's CPU time."""
    args = run.parse_args(["--workloads", "W1", "--clock", "cpu"])
    child = run.parse_args(run.child_argv(args, ["--time", "W1"]))
    assert child.clock == "cpu" and run.CLOCKS[child.clock] is run.time.process_time
    reads = []
    monkeypatch.setitem(run.CLOCKS, "cpu", lambda: reads.append(1) or 0.0)
    case = type("C", (), {"mode": "m", "step": lambda self: None, "clear_grads": lambda self: None})()
    assert run._interleave(child, [case])["m"]["n_time_steps"] == child.steps
    assert len(reads) == 2 * child.steps
