"""The GPU check of issue 13: the Triton path of chunked_logits on one CUDA GPU, in minutes.

    python benchmarks/gpu_check.py --out bench_out/gpu      # on a machine with one CUDA GPU
    python benchmarks/gpu_check.py --dry-run                # the same plumbing on the CPU, tiny sizes

Runs the tests marked ``gpu``, then per workload (W1-W5 at the miles PR's shapes, and
WV: Qwen3-0.6B's lm_head, V 151936) stock Inductor, chunked_logits static and
``dynamic=True``, and Liger's / Cut Cross-Entropy's fused linear cross-entropy where
they apply and import: peak memory above the inputs, step time vs stock (CUDA events,
interleaved), max error vs FP64.  Saves and checks the generated code of W1, W3 and
W4.  Writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out``.  Each workload
runs under a time guard (in its own process on the GPU), inside an overall budget
(the defaults fit in 8 minutes).  See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
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
from benchmarks.cases import sizes  # noqa: E402
from benchmarks.memory import MALLOC_ENV  # noqa: E402
from benchmarks.run import source_version  # noqa: E402
from fx_passes.env import without_ours  # noqa: E402

WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "WV")
# The dry run's sizes: tests/test_codegen.py's [256, 4096], so that in a whole test run
# Inductor's cache already holds most of the graphs (compiling them is most of the time).
DRY_T, DRY_V = 256, 4096
DRY_V_WV = 151936 // 32  # WV keeps a larger vocabulary that is no power of two
GRACE_S = 30  # a child past its guard finishes the step it is in; killed after this
MIN_CASE_S = 20  # less budget left than this: the remaining workloads are skipped


def case_sizes(name: str, dry_run: bool) -> tuple[int, int]:
    """(T, V) of workload ``name``: the issue's sizes (fx_passes/testing/workloads.py), or the dry run's."""
    if not dry_run:
        return sizes(name)
    return DRY_T, DRY_V_WV if name == "WV" else DRY_V


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_out/gpu", help="output folder (default bench_out/gpu)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: check the plumbing")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list (default: all)")
    p.add_argument("--budget", type=float, default=450, help="seconds for the whole run (default 450)")
    p.add_argument("--case-guard", type=float, default=80, help="seconds per workload (default 80)")
    p.add_argument("--tests-guard", type=float, default=120, help="seconds for the GPU tests (default 120)")
    p.add_argument("--steps", type=int, default=None, help="timing rounds (default 10; dry run 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 2; dry run 1)")
    p.add_argument("--skip-tests", action="store_true", help="do not run pytest -m gpu")
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        p.error(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
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
    """``pytest -m gpu tests/test_gpu.py`` in a child; its log goes to gpu_tests.log."""
    if args.skip_tests:
        return {"summary": "not run (--skip-tests)"}
    if importlib.util.find_spec("pytest") is None:
        return {"summary": "not run: pytest is not importable here (pip install --no-deps a pytest wheel)"}
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    guard = max(1.0, min(args.tests_guard, end - time.monotonic()))
    rc, log = run_child(cmd, guard, env)
    (out / "gpu_tests.log").write_text(log)
    summary = _last_line(log).strip("= ") if rc is not None else f"killed at the {guard:.0f} s guard"
    return {"summary": summary, "exit": rc, "seconds": time.monotonic() - t0, "log": "gpu_tests.log"}


def _last_line(log: str) -> str:
    return next((ln for ln in reversed(log.strip().splitlines()) if ln.strip()), "(no output)")


def run_group(args, group: list[str], guard: float, out: pathlib.Path, env: dict) -> list[dict]:
    """Workloads ``group`` in one child (benchmarks/gpu_case.py), each under ``guard``;
    what each wrote, even if the child was killed."""
    shapes = {name: case_sizes(name, args.dry_run) for name in group}
    specs = [f"{name}:{T}:{V}" for name, (T, V) in shapes.items()]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_case.py"), *specs, "--out", str(out),
           "--device", "cpu" if args.dry_run else "cuda", "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--guard", f"{guard:.0f}"]
    paths = [out / "cases" / f"{name}.json" for name in group]
    for path in paths:
        path.unlink(missing_ok=True)
    timeout = guard * len(group) + GRACE_S
    rc, log = run_child(cmd, timeout, env)
    (out / "cases" / f"{'_'.join(group)}.log").write_text(log)
    why = f"exited {rc}: {_last_line(log)[:200]}" if rc else f"was killed {timeout:.0f} s after its start"
    results = []
    for name, path in zip(group, paths):
        T, V = shapes[name]
        result = json.loads(path.read_text()) if path.exists() else {"workload": name, "T": T, "V": V,
                                                                      "rows": {}, "notes": []}
        if rc != 0:
            result["notes"].append(f"the process {why}; kept what this workload had written")
        results.append(result)
    return results


def print_case(result: dict) -> None:
    """A few lines per workload while the run goes on (the full table comes at the end)."""
    fmt = gpu_report.fmt
    print(f"{result['workload']} [{result['T']} x {result['V']}] ({fmt(result.get('seconds'), '.0f')} s)",
          flush=True)
    for mode, r in result.get("rows", {}).items():
        if "peak_mib" in r:
            print(f"  {mode:<19} peak {r['peak_mib']:9.1f} MiB  "
                  f"vs stock {fmt(r.get('t_ratio_vs_stock'), '.3f'):>6}  "
                  f"err out {fmt(r.get('out_err'), '.1e')} grad {fmt(r.get('grad_err'), '.1e')}", flush=True)
    for line in result["notes"]:
        print(f"  note: {line}", flush=True)


def groups(args) -> list[list[str]]:
    """One process per workload on the GPU; one for all of them in the dry run, where
    importing torch and Inductor in each process would cost more than the tiny cases."""
    return [args.workloads] if args.dry_run else [[name] for name in args.workloads]


def run_workloads(args, out: pathlib.Path, env: dict, end: float) -> tuple[list[dict], list[str]]:
    """Each workload under its time guard, as long as the budget lasts."""
    results, skipped, todo = [], [], groups(args)
    for i, group in enumerate(todo):
        left = end - time.monotonic()
        if left < MIN_CASE_S * len(group) + GRACE_S:
            rest = [name for g in todo[i:] for name in g]
            skipped.append(f"budget ({args.budget:.0f} s) spent: {', '.join(rest)} skipped")
            print(skipped[-1], flush=True)
            break
        guard = min(args.case_guard, (left - GRACE_S) / len(group))
        for result in run_group(args, group, guard, out, env):
            print_case(result)
            results.append(result)
    return results, skipped


def predicted() -> str:
    """The cost model's H100 / H200 table (``benchmarks/cost_model.py``), or one line
    saying why there is none: a checkout whose plans or sizes differ must not stop the check."""
    try:
        from benchmarks import cost_model
        return cost_model.report()
    except Exception as e:  # noqa: BLE001 (any failure of the model is reported, not raised)
        return f"(no prediction: the cost model failed: {type(e).__name__}: {str(e)[:200]})"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device here: run with --dry-run to check the plumbing on the CPU", file=sys.stderr)
        return 2
    end = time.monotonic() + args.budget
    out = pathlib.Path(args.out)
    (out / "cases").mkdir(parents=True, exist_ok=True)
    meta = versions(args.dry_run)
    print(f"{meta['date']}  {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  "
          f"{meta['source']}", flush=True)
    env = child_env(args.dry_run)
    tests = run_tests(args, out, env, end)
    print(f"GPU tests: {tests['summary']}", flush=True)
    cases, notes = run_workloads(args, out, env, end)
    notes += [f"{c['workload']}: {line}" for c in cases for line in c["notes"]]
    rows = gpu_report.flat_rows(cases)
    notes += [f"{r['workload']}: {r['mode']} skipped: {r['skipped']}" for r in rows if "skipped" in r]
    summary = {"meta": meta, "tests": tests, "rows": rows, "cases": cases,
               "targets": gpu_report.targets(rows), "notes": notes, "prediction": predicted()}
    gpu_report.write_json(out / "gpu_check.json", summary)
    page = gpu_report.markdown(summary)
    (out / "gpu_check.md").write_text(page)
    print(page, flush=True)
    print(f"written: {out / 'gpu_check.json'}, {out / 'gpu_check.md'}, generated code in {out / 'code'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
