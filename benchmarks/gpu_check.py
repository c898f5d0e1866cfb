"""The GPU check: chunked_logits on one CUDA GPU at a large model's lm_head, in one run of 9 minutes.

    python benchmarks/gpu_check.py --out bench_out/gpu      # on a machine with one CUDA GPU
    python benchmarks/gpu_check.py --dry-run                # the same code paths on the CPU, tiny sizes

Runs the tests marked ``gpu`` under a guard, then the cases of ``PLAN`` (H 4096, V 151936),
most decisive first, each in its own process (benchmarks/gpu_case.py) under its time
guard: the lm_head loss in the graph and per token (W4L, WV) for stock Inductor and ours
with each lm_head plan a GPU runs, a ``reduce-overhead`` step, WD, WP, a vocab-parallel
step on one rank, a cross-entropy with half its labels ignored (W4C: the host read's
cost), a masked policy loss with its entropy metric (W4E: the same on the per-token
path) and a masked distillation loss (WDM: the same in the row-local engine).  Per
step: peak memory, time vs stock (interleaved medians, CUDA events), kernels
and GEMM TFLOPS (profiler), max error vs FP64, host syncs (``set_sync_debug_mode("error")``
and the profiler's sync ops), CUDA-graph replays, and the cost model's prediction beside
it.  ``gpu_check.json`` and ``gpu_check.md`` in ``--out`` are rewritten after every case;
a case that fails or is killed is recorded and the rest go on; the overall budget (480 s)
ends the run.  See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import gpu_report  # noqa: E402
from benchmarks.memory import MALLOC_ENV  # noqa: E402
from benchmarks.run import source_version  # noqa: E402
from fx_passes.env import without_ours  # noqa: E402

# The cases, in the order they run (the most decisive first; the budget cuts the tail):
# (case, T, V, H, guard s) on a GPU.  benchmarks/gpu_case.py's CASES say what each is.
FULL_V, FULL_H = 151936, 4096
PLAN = (
    ("W4L", 8192, FULL_V, FULL_H, 55),
    ("WV", 8192, FULL_V, FULL_H, 55),
    ("W4L-tok", 8192, FULL_V, FULL_H, 45),
    ("WV-tok", 8192, FULL_V, FULL_H, 45),
    ("RO", 8192, FULL_V, FULL_H, 35),
    ("WD", 4096, FULL_V, FULL_H, 30),
    ("WP", 4096, FULL_V, 0, 25),
    ("VP", 8192, FULL_V, FULL_H, 50),  # (21.5 s with two modes on 2026-12-04; four now)
    ("W4C", 8192, FULL_V, FULL_H, 35),
    ("W4E", 8192, FULL_V, FULL_H, 35),
    ("WDM", 4096, FULL_V, FULL_H, 30),
    ("W4L", 16384, FULL_V, FULL_H, 40),
    ("WV", 16384, FULL_V, FULL_H, 40),
)
CASE_NAMES = tuple(dict.fromkeys(c[0] for c in PLAN))
# The dry run's sizes: tiny, a vocabulary that is no power of two; T 16384's repeat is
# left out (the same code at another size).
DRY_T, DRY_V, DRY_H = 64, 600, 64
GRACE_S = 20  # a child past its guard finishes the step it is in; killed after this
MIN_CASE_S = 15  # less budget left than this: the remaining cases are skipped


def planned(args) -> list[tuple[str, int, int, int, float]]:
    """(case, T, V, H, guard) of each case to run: the plan's, or the dry run's sizes."""
    rows = [c for c in PLAN if c[0] in args.cases]
    if not args.dry_run:
        return rows
    seen, out = set(), []
    for key, _, _, H, guard in rows:
        if key not in seen:
            seen.add(key)
            out.append((key, DRY_T, DRY_V, DRY_H if H else 0, guard))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_out/gpu", help="output folder (default bench_out/gpu)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, the gpu plan forced")
    p.add_argument("--cases", default=",".join(CASE_NAMES), help="comma list (default: all)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run (default 480; dry run 280)")
    p.add_argument("--case-guard", type=float, default=None,
                   help="seconds per case (default: the plan's, 25-55 s)")
    # (the 13 GPU tests took about 135 s with a cold Inductor cache on an H200: 60 s cut six)
    p.add_argument("--tests-guard", type=float, default=150, help="seconds for the GPU tests (default 150)")
    p.add_argument("--steps", type=int, default=None, help="timing rounds (default 10; dry run 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 2; dry run 1)")
    p.add_argument("--skip-tests", action="store_true", help="do not run pytest -m gpu")
    args = p.parse_args(argv)
    args.cases = [w.strip() for w in args.cases.split(",") if w.strip()]
    unknown = sorted(set(args.cases) - set(CASE_NAMES))
    if unknown:
        p.error(f"unknown case(s) {unknown}; choose from {', '.join(CASE_NAMES)}")
    args.budget = args.budget if args.budget is not None else (280 if args.dry_run else 480)
    args.steps = args.steps or (2 if args.dry_run else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 2)
    return args


def versions(dry_run: bool) -> dict:
    """What the results were measured on (printed first, and kept in the JSON)."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": device + (" (dry run on the CPU)" if dry_run else ""),
            "torch": torch.__version__, "triton": triton_version, "python": sys.version.split()[0],
            "source": source_version(), "dry_run": dry_run,
            "command": shlex.join(["python", *sys.argv])}


def child_env(dry_run: bool) -> dict:
    """The children import this checkout (installed or not) and never see the package's
    switches (CHUNKED_LOGITS=1 would put the pass into the stock baseline)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = without_ours(PYTHONPATH=path)
    if dry_run:
        env.update(MALLOC_ENV)  # the CPU stand-in reads VmHWM: see benchmarks/README.md
    return env


def run_child(cmd: list[str], timeout: float, env: dict) -> tuple[int | None, str]:
    """(exit status or None if killed at ``timeout``, stdout+stderr).  The child runs in
    its own process group, so a kill also ends Inductor's compile workers."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


def run_tests(args, out: pathlib.Path, env: dict, end: float) -> dict:
    """``pytest -m gpu tests/test_gpu.py`` in a child under its guard; its log goes to
    gpu_tests.log, and a killed run still reports the tests it finished."""
    if args.skip_tests:
        return {"summary": "not run (--skip-tests)"}
    if importlib.util.find_spec("pytest") is None:
        return {"summary": "not run: pytest is not importable here (pip install --no-deps a pytest wheel)"}
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    guard = max(1.0, min(args.tests_guard, end - time.monotonic()))
    rc, log = run_child(cmd, guard, env)
    (out / "gpu_tests.log").write_text(log)
    outcomes = outcomes_of(log)
    if rc is None:
        done = ", ".join(f"{n} {k.lower()}" for k, n in outcomes.items() if n) or "none finished"
        summary = f"killed at the {guard:.0f} s guard ({done})"
    else:
        summary = _last_line(log).strip("= ")
    return {"summary": summary, "exit": rc, "seconds": time.monotonic() - t0, "outcomes": outcomes,
            "failed": re.findall(r"(\S+::\S+) FAILED", log), "log": "gpu_tests.log"}


def outcomes_of(log: str) -> dict:
    """How many tests of a ``pytest -v`` log (whole or cut short) passed, failed ..."""
    return {k: len(re.findall(rf"::\S+ {k}\b", log)) for k in ("PASSED", "FAILED", "SKIPPED", "ERROR")}


def _last_line(log: str) -> str:
    return next((ln for ln in reversed(log.strip().splitlines()) if ln.strip()), "(no output)")


def case_file(out: pathlib.Path, key: str, T: int) -> pathlib.Path:
    return out / "cases" / f"{key}_{T}.json"


def run_group(args, group: list[tuple], out: pathlib.Path, env: dict, end: float) -> list[dict]:
    """Cases ``group`` in one child (benchmarks/gpu_case.py), each under its guard (cut
    to the budget left); what each wrote, even if the child was killed."""
    paths = [case_file(out, key, T) for key, T, *_ in group]
    for path in paths:
        path.unlink(missing_ok=True)
    left = end - time.monotonic()
    guards = [args.case_guard or guard for *_, guard in group]
    if sum(guards) + GRACE_S > left:  # the guards shrunk in proportion to fit what is left
        guards = [max(1.0, g * (left - GRACE_S) / sum(guards)) for g in guards]
    specs = [f"{key}:{T}:{V}:{H}:{g:.0f}" for (key, T, V, H, _), g in zip(group, guards)]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_case.py"), *specs, "--out", str(out),
           "--device", "cpu" if args.dry_run else "cuda", "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    if args.dry_run:
        cmd.append("--dry-run")
    timeout = min(sum(guards) + GRACE_S, max(1.0, left))
    rc, log = run_child(cmd, timeout, env)
    (out / "cases" / f"{'_'.join(s.replace(':', '-') for s in specs)}.log").write_text(log)
    why = f"exited {rc}: {_last_line(log)[:200]}" if rc else f"was killed {timeout:.0f} s after its start"
    results = []
    for (key, T, V, H, _), path in zip(group, paths):
        result = json.loads(path.read_text()) if path.exists() else {
            "case": key, "workload": key, "T": T, "V": V, "H": H, "rows": {}, "notes": []}
        if rc != 0:
            result["notes"].append(f"the process {why}; kept what this case had written")
        results.append(result)
    return results


def print_case(result: dict) -> None:
    """A few lines per case while the run goes on (the table is rewritten after each)."""
    fmt = gpu_report.fmt
    print(f"{result['case']} [T {result['T']}, V {result['V']}, H {result['H']}] "
          f"({fmt(result.get('seconds'), '.0f')} s)", flush=True)
    for mode, r in result.get("rows", {}).items():
        pred = (r.get("predicted") or {}).get("ratio")
        print(f"  {mode:<16} peak {fmt(r.get('peak_mib'), '9.1f')} MiB  vs stock "
              f"{fmt(r.get('t_ratio_vs_stock'), '.3f'):>6} (predicted {fmt(pred, '.2f')})  "
              f"kernels {fmt(r.get('kernels'), 'd')}  sync {r.get('sync_mode', '-')}  "
              f"err out {fmt(r.get('out_err'), '.1e')} grad {fmt(r.get('grad_err'), '.1e')}"
              + (f"  ERROR {r['error']}" if "error" in r else ""), flush=True)
    for line in result["notes"]:
        print(f"  note: {line}", flush=True)


def groups(args) -> list[list[tuple]]:
    """One process per case on the GPU (a fresh allocator; a kill takes one case); one
    for all of them in the dry run, where importing torch and Inductor for each would
    cost more than the tiny cases."""
    cases = planned(args)
    return [cases] if args.dry_run else [[c] for c in cases]


def write_summary(args, out: pathlib.Path, meta: dict, tests: dict, cases: list[dict],
                  skipped: list[str]) -> str:
    """gpu_check.json and gpu_check.md from what has run so far (after every case)."""
    rows = gpu_report.flat_rows(cases)
    notes = skipped + [f"{c['case']} (T {c['T']}): {line}" for c in cases for line in c["notes"]]
    summary = {"meta": meta, "tests": tests, "rows": rows, "cases": cases, "notes": notes,
               "complete": False}
    gpu_report.write_json(out / "gpu_check.json", summary)
    page = gpu_report.markdown(summary)
    (out / "gpu_check.md").write_text(page)
    return page


def run_cases(args, out: pathlib.Path, env: dict, end: float, report) -> tuple[list[dict], list[str]]:
    """Each case under its time guard, as long as the budget lasts; ``report(cases,
    skipped)`` after each."""
    results, skipped, todo = [], [], groups(args)
    for i, group in enumerate(todo):
        if end - time.monotonic() < MIN_CASE_S * len(group) + GRACE_S:
            rest = [f"{key} (T {T})" for g in todo[i:] for key, T, *_ in g]
            skipped.append(f"budget ({args.budget:.0f} s) spent: {', '.join(rest)} skipped")
            print(skipped[-1], flush=True)
            break
        for result in run_group(args, group, out, env, end):
            print_case(result)
            results.append(result)
        report(results, skipped)
    return results, skipped


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device here: run with --dry-run to check the plumbing on the CPU", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    end = t0 + args.budget
    out = pathlib.Path(args.out)
    (out / "cases").mkdir(parents=True, exist_ok=True)
    meta = versions(args.dry_run)
    print(f"{meta['date']}  {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  "
          f"{meta['source']}", flush=True)
    env = child_env(args.dry_run)
    tests = run_tests(args, out, env, end)
    print(f"GPU tests: {tests['summary']}", flush=True)
    write_summary(args, out, meta, tests, [], [])

    def report(cases, skipped):
        write_summary(args, out, meta, tests, cases, skipped)
    cases, skipped = run_cases(args, out, env, end, report)
    meta["seconds"] = time.monotonic() - t0
    page = write_summary(args, out, meta, tests, cases, skipped)
    summary = json.loads((out / "gpu_check.json").read_text())
    summary["complete"] = True
    gpu_report.write_json(out / "gpu_check.json", summary)
    print(page, flush=True)
    print(f"written: {out / 'gpu_check.json'}, {out / 'gpu_check.md'} ({meta['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
