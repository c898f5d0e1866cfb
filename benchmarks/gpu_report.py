"""The GPU check's results: one row per (case, mode), as strict JSON and a Markdown page."""

from __future__ import annotations

import json
import math
import pathlib


def write_json(path: pathlib.Path, obj) -> None:
    """``obj`` as strict JSON: a missing number (NaN, e.g. the gradient error of a
    scoring step, which has no gradients) is written as null."""
    def clean(x):
        if isinstance(x, float) and math.isnan(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(clean(obj), indent=1, allow_nan=False))
    tmp.replace(path)  # whole or not at all: the parent may kill the writer at any moment


def flat_rows(cases: list[dict]) -> list[dict]:
    """One row per (case, mode) of the children's results."""
    rows = []
    for case in cases:
        for mode, r in case.get("rows", {}).items():
            rows.append({"case": case["case"], "mode": mode, "T": case["T"], "V": case["V"],
                         "H": case.get("H", 0), **r})
    return rows


def fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _status(row: dict) -> str:
    if "error" in row:
        return f"ERROR: {row['error']}"
    parts = []
    c = row.get("chunked_logits")
    if c is not None:
        parts.append(", ".join(f"{k}={v}" for k, v in sorted(c.items())) or "no rewrite")
    if row.get("check_errors"):
        parts.append("check failed: " + "; ".join(row["check_errors"]))
    if row.get("cudagraph"):
        parts.append(", ".join(f"{k}={v}" for k, v in sorted(row["cudagraph"].items())))
    return "; ".join(parts)


def _predicted(row: dict) -> str:
    p = row.get("predicted")
    return "-" if not p else f"{p['ms']:.2f} ms, {p['ratio']:.2f}x"


def _syncs(row: dict) -> str:
    if "sync_mode" not in row:
        return "-"
    ops = ", ".join(row.get("syncs") or []) or "none"
    return f"{row['sync_mode']}; ops: {ops}"


RESULT_COLUMNS = (  # header, cell
    ("case", lambda r: r["case"]),
    ("mode", lambda r: r["mode"]),
    ("T / V / H", lambda r: f"{r['T']} / {r['V']} / {r['H'] or '-'}"),
    ("peak MiB", lambda r: fmt(r.get("peak_mib"), ".1f")),
    ("median ms", lambda r: fmt(r.get("t_median_ms"), ".2f")),
    ("vs stock", lambda r: fmt(r.get("t_ratio_vs_stock"), ".3f")),
    ("predicted (H200)", _predicted),
    ("kernels", lambda r: fmt(r.get("kernels"), "d")),
    ("GEMM TFLOPS", lambda r: fmt(r.get("gemm_tflops"), ".3g")),
    ("out err", lambda r: fmt(r.get("out_err"), ".1e")),
    ("grad err", lambda r: fmt(r.get("grad_err"), ".1e")),
    ("host syncs", _syncs),
    ("replays", lambda r: fmt(r.get("replays"), "d")),
    ("compile s", lambda r: fmt(r.get("compile_s"), ".1f")),
    ("pass / status", _status),
)


def _top(row: dict) -> str:
    return "; ".join(f"{name} x{n} {ms:.2f}" for name, n, ms in row.get("top_kernels") or []) or "-"


TIMELINE_COLUMNS = (  # header, cell: the profiled step's device time (gpu_case.timeline)
    ("case", lambda r: r["case"]),
    ("mode", lambda r: r["mode"]),
    ("span ms", lambda r: fmt(r.get("span_ms"), ".2f")),
    ("busy ms", lambda r: fmt(r.get("busy_ms"), ".2f")),
    ("idle ms", lambda r: fmt(r.get("idle_ms"), ".2f")),
    ("GEMM ms", lambda r: fmt(r.get("gemm_ms"), ".2f")),
    ("other kernels ms", lambda r: fmt(r.get("other_ms"), ".2f")),
    ("memset / copy ms", lambda r: fmt(r.get("copy_ms"), ".2f")),
    ("largest other kernels (launches, ms)", _top),
)


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return out + ["| " + " | ".join(cells) + " |" for cells in lines]


def markdown(summary: dict) -> str:
    """The page written next to the JSON after every case (and printed at the end)."""
    m = summary["meta"]
    out = [f"# GPU check: {m['date']}", "",
           f"device: {m['device']}; torch {m['torch']}; triton {m['triton']}; {m['source']}",
           f"command: `{m['command']}`", ""]
    if m["dry_run"]:
        out += [("**Dry run**: CPU stand-ins at tiny sizes (VmHWM for max_memory_allocated, "
                 "perf_counter for CUDA events, ATen ops for kernels, the GEMM ops' CPU time for "
                 "the GEMM kernels'), the `gpu` plan on the test-only out_dtype kernels. These numbers "
                 "say nothing about a GPU; `predicted` is the cost model's H200 at the row's sizes."), ""]
    if "seconds" in m:
        out += [f"wall time: {m['seconds']:.0f} s", ""]
    out += [f"GPU tests (`pytest -m gpu tests/test_gpu.py`): {summary['tests']['summary']}", ""]
    out += _table([h for h, _ in RESULT_COLUMNS],
                  [[cell(r) for _, cell in RESULT_COLUMNS] for r in summary["rows"]])
    timed = [r for r in summary["rows"] if "busy_ms" in r]
    if timed:
        out += ["", "Where the profiled step's time went (one step under the profiler: the span from "
                "its first kernel to its last, the kernels' union, the device idle in between):", ""]
        out += _table([h for h, _ in TIMELINE_COLUMNS],
                      [[cell(r) for _, cell in TIMELINE_COLUMNS] for r in timed])
    if summary["notes"]:
        out += ["", "Notes:", ""] + [f"* {line}" for line in summary["notes"]]
    return "\n".join(out) + "\n"


# --- several runs merged: docs/gpu.md's Results table -------------------------------

def merged(paths: list[pathlib.Path]) -> list[dict]:
    """One row per (case, T, mode) over the runs' JSON files, a later file's row
    replacing an earlier one's (a case rerun after a fix), each with its run's file
    name and its peak memory over its case's stock row's (``peak_vs_stock``)."""
    rows: dict[tuple, dict] = {}
    for path in paths:
        for r in json.loads(path.read_text())["rows"]:
            rows[(r["case"], r["T"], r["mode"])] = {**r, "run": path.stem}
    out = list(rows.values())
    for r in out:
        stock = rows.get((r["case"], r["T"], r["mode"].replace("ours", "inductor").split(":")[0]
                          + (":ro" if r["mode"].endswith(":ro") else "")))
        measured = stock and min(r.get("peak_mib") or 0, stock.get("peak_mib") or 0) >= 1
        r["peak_vs_stock"] = r["peak_mib"] / stock["peak_mib"] if measured else None  # (CUDA graphs:
        # a replay's memory is the graph pool's, not counted: ~0 MiB)
    return out


def _sync_cell(r: dict) -> str:
    mode = r.get("sync_mode", "-")
    return mode.replace("fx_passes/", "") if mode.startswith("SYNC") else mode


SUMMARY_COLUMNS = (  # header, cell
    ("case", lambda r: r["case"]),
    ("T", lambda r: str(r["T"])),
    ("mode", lambda r: r["mode"]),
    ("peak MiB", lambda r: fmt(r.get("peak_mib"), ".0f")),
    ("peak vs stock", lambda r: fmt(r.get("peak_vs_stock"), ".2f")),
    ("median ms", lambda r: fmt(r.get("t_median_ms"), ".1f")),
    ("time vs stock", lambda r: fmt(r.get("t_ratio_vs_stock"), ".2f")),
    ("predicted", lambda r: "-" if not r.get("predicted") else f"{r['predicted']['ratio']:.2f}"),
    ("host syncs", _sync_cell),
    ("run", lambda r: r["run"]),
)


def summary_table(paths: list[pathlib.Path]) -> str:
    """The merged runs as one Markdown table (errors, kernels and counters stay in each
    run's own page)."""
    rows = merged(paths)
    return "\n".join(_table([h for h, _ in SUMMARY_COLUMNS],
                            [[cell(r) for _, cell in SUMMARY_COLUMNS] for r in rows])) + "\n"


if __name__ == "__main__":
    import sys
    if len(sys.argv) < 2:
        sys.exit("usage: python benchmarks/gpu_report.py RUN.json [RUN.json ...]  (later runs replace "
                 "earlier rows)")
    print(summary_table([pathlib.Path(p) for p in sys.argv[1:]]), end="")
