"""The GPU check's results: one row per (workload, mode), issue 13's targets, and a Markdown page."""

from __future__ import annotations

import json
import math
import pathlib

SCORING = ("W1", "W2")
CHUNKED = ("chunked_logits", "chunked_logits_dyn")
W2_PEAK_MIB = 64  # scoring's limit is its [T] outputs (~0): the peak is read in MiB (benchmarks/README.md)
PEAK_OVER_LIMIT = {"W3": 1.15, "W4": 1.5}
TIME_VS_STOCK = 1.0


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
    """One row per (workload, mode) of the children's results, with peak/limit."""
    rows = []
    for case in cases:
        for mode, r in case.get("rows", {}).items():
            row = {"workload": case["workload"], "mode": mode, "T": case["T"], "V": case["V"],
                   "limit_mib": case["limit_mib"], **r}
            if case["workload"] not in SCORING and "peak_mib" in r:
                row["peak_over_limit"] = r["peak_mib"] / case["limit_mib"]
            rows.append(row)
    return rows


def _target(what: str, row: dict, key: str, bound) -> dict:
    value = row.get(key)
    ok = None if value is None or bound is None else bool(value <= bound)
    return {"target": what, "workload": row["workload"], "mode": row["mode"], "value": value,
            "bound": bound, "ok": ok}


def targets(rows: list[dict]) -> list[dict]:
    """Issue 13's targets for both chunked modes; ``ok`` is None where a number is missing."""
    by = {(r["workload"], r["mode"]): r for r in rows}
    out = []
    for r in (r for r in rows if r["mode"] in CHUNKED):
        w = r["workload"]
        if w == "W2":
            out.append(_target(f"peak <= {W2_PEAK_MIB} MiB", r, "peak_mib", W2_PEAK_MIB))
        bound = PEAK_OVER_LIMIT.get(w)
        if bound:
            out.append(_target(f"peak/limit <= {bound}", r, "peak_over_limit", bound))
        out.append(_target(f"time vs stock <= {TIME_VS_STOCK}", r, "t_ratio_vs_stock", TIME_VS_STOCK))
        for base in ("liger", "cce"):
            other = by.get((w, base), {})
            if "skipped" in other or not other:
                continue
            out.append(_target(f"peak <= {base}'s", r, "peak_mib", other.get("peak_mib")))
            out.append(_target(f"median time <= {base}'s", r, "t_median_ms", other.get("t_median_ms")))
    return out


def fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _status(row: dict) -> str:
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    if "error" in row:
        return f"ERROR: {row['error']}"
    c = row.get("chunked_logits")
    return "" if c is None else ", ".join(f"{k}={v}" for k, v in sorted(c.items())) or "no rewrite"


RESULT_COLUMNS = (  # header, cell
    ("workload", lambda r: r["workload"]),
    ("mode", lambda r: r["mode"]),
    ("T x V", lambda r: f"{r['T']} x {r['V']}"),
    ("peak MiB", lambda r: fmt(r.get("peak_mib"), ".1f")),
    ("limit MiB", lambda r: fmt(r["limit_mib"], ".2f" if r["workload"] in SCORING else ".1f")),
    ("peak/limit", lambda r: "n/a" if r["workload"] in SCORING else fmt(r.get("peak_over_limit"), ".2f")),
    ("median ms", lambda r: fmt(r.get("t_median_ms"), ".2f")),
    ("vs stock", lambda r: fmt(r.get("t_ratio_vs_stock"), ".3f")),
    ("out err", lambda r: fmt(r.get("out_err"), ".1e")),
    ("grad err", lambda r: fmt(r.get("grad_err"), ".1e")),
    ("compile s", lambda r: fmt(r.get("compile_s"), ".1f")),
    ("pass / status", _status),
)


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return out + ["| " + " | ".join(cells) + " |" for cells in lines]


def codegen_lines(cases: list[dict]) -> list[list[str]]:
    lines = []
    for case in cases:
        for mode, c in case.get("codegen", {}).items():
            flagged = ", ".join("(" + ", ".join(d) + ")" for d in c["flagged"]) or "none"
            role = "control (stock)" if mode == "inductor" else ("ok" if not c["flagged"] else "FAIL")
            lines.append([case["workload"], mode, str(len(c["files"])), str(c["checked_files"]), flagged,
                          role])
    return lines


def markdown(summary: dict) -> str:
    """The page written next to the JSON (and printed at the end of the run)."""
    m = summary["meta"]
    out = [f"# GPU check: {m['date']}", "",
           f"device: {m['device']}; torch {m['torch']}; triton {m['triton']}; {m['source']}",
           f"command: `{m['command']}`", ""]
    if m["dry_run"]:
        out += [("**Dry run**: CPU stand-ins at tiny sizes (VmHWM for max_memory_allocated, "
                 "perf_counter for CUDA events). These numbers say nothing about a GPU."), ""]
    out += [f"GPU tests (`pytest -m gpu tests/test_gpu.py`): {summary['tests']['summary']}", ""]
    out += _table([h for h, _ in RESULT_COLUMNS],
                  [[cell(r) for _, cell in RESULT_COLUMNS] for r in summary["rows"]])
    out += ["", "Generated code (FP32 buffers of the full [T, V] size; `checked` = files read):", ""]
    out += _table(["workload", "mode", "files", "checked", "FP32 [T, V] buffers", "result"],
                  codegen_lines(summary["cases"]))
    out += ["", "Targets (issue 13):", ""]
    out += _table(["workload", "mode", "target", "value", "bound", "met"],
                  [[t["workload"], t["mode"], t["target"], fmt(t["value"], ".3g"), fmt(t["bound"], ".3g"),
                    {True: "yes", False: "NO", None: "-"}[t["ok"]]] for t in summary["targets"]])
    if summary["notes"]:
        out += ["", "Notes:", ""] + [f"* {line}" for line in summary["notes"]]
    if summary.get("prediction"):
        out += ["", "## Predicted by the cost model (not measured here)", "", PREDICTION_NOTE, "",
                summary["prediction"]]
    return "\n".join(out) + "\n"


PREDICTION_NOTE = ("`benchmarks/cost_model.py` (docs/gpu.md, \"The cost model\"): compare its "
                   "`loss in graph` rows of W4 and WV (`gpu` plan) with the `chunked_logits` rows above, "
                   "which compute the loss in the graph.")
