"""Benchmark the workloads under eager, stock Inductor, Inductor+AutoChunker and chunked_logits.

    .venv/bin/python benchmarks/run.py                        # full size, W1-W5
    .venv/bin/python benchmarks/run.py --scale 8 --workloads W1,W3
    .venv/bin/python benchmarks/run.py --workloads U1,U2,U3   # the FP32 upgrade (issue 6)
    .venv/bin/python benchmarks/run.py --workloads W4L --steps 3   # W4 at long T (issue 3)
    .venv/bin/python benchmarks/run.py --workloads WV --vocab 32768 --rows 256,1024,4096 \
        --modes inductor,chunked_logits,torch_lce,torch_lce_compiled --plot   # peers, against T

The parent process only orchestrates: every memory case (workload, mode) runs in a
fresh child process (``--case W3 --mode chunked_logits``), and the timing of each
workload runs in one child process (``--time W3``) that interleaves the modes step
by step.  See benchmarks/README.md for the method and the columns.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import baselines, plot, report  # noqa: E402
from benchmarks.cases import (  # noqa: E402
    ALL_WORKLOADS,
    LM_HEAD_WORKLOADS,
    MODES,
    STOCK,
    WORKLOADS,
    default_modes,
    limit_bytes,
    sizes,
)
from benchmarks.memory import MALLOC_ENV, MIB  # noqa: E402
from fx_passes.env import without_ours  # noqa: E402

RESULT_TAG = "@@RESULT "
# --clock: wall-clock time, or this process's CPU time (every thread's, user + system)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
DEFAULT_WORKLOADS = tuple(WORKLOADS)  # W1-W5; also W4L, U1-U3 (workloads.EXTRA_WORKLOADS)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help=f"comma list of {', '.join(ALL_WORKLOADS)} (default: W1-W5)")
    p.add_argument("--modes", default=None, help=f"comma list of {', '.join(MODES)} "
                   "(default: those that apply to the workload, see benchmarks/README.md)")
    p.add_argument("--time-modes", default=None, help="modes to time (default: --modes)")
    p.add_argument("--scale", type=int, default=1, help="divide T and V by this (quick runs)")
    p.add_argument("--steps", type=int, default=7, help="timed steps per mode (after warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps (the first compiles)")
    p.add_argument("--skip-time", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--rows", default=None,
                   help="comma list of T values, each its own set of cases (default: the workload's T)")
    p.add_argument("--vocab", type=int, default=0, help="V instead of the workload's (before --scale)")
    p.add_argument("--mask", type=float, default=0.5,
                   help="share of the rows the masked workloads (W4C, W4M, W4E, W4S, WDM, WDE) leave out of "
                        "the loss")
    p.add_argument("--mask-style", default="prompt", choices=("prompt", "padding"),
                   help="which rows of each sequence they leave out: the first (prompt) or the last")
    p.add_argument("--csv", default="bench_out/results.csv", help="where to write the CSV")
    p.add_argument("--plot", action="store_true",
                   help="also write memory and step time against T as a PNG next to the CSV (matplotlib)")
    p.add_argument("--threads", type=int, default=0, help="torch threads in the children (0: default)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per child process")
    p.add_argument("--clock", default="wall", choices=tuple(CLOCKS),
                   help="what a step's time is: wall-clock time, or the process's CPU time (user + system, "
                        "all threads): on a machine whose cores other work shares, CPU time leaves out the "
                        "time the step waited for a core (see benchmarks/README.md)")
    p.add_argument("--time-rows-div", type=int, default=0,
                   help="time W4/W4L at T divided by this (default 0: 8 on a CPU without native bf16 "
                        "matmul, where stock's bf16 GEMMs take minutes a step; else 1)")
    # internal: what a child process runs
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--time", help=argparse.SUPPRESS)
    p.add_argument("--report", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.workloads = parse_names(args.workloads, ALL_WORKLOADS)
    args.modes = parse_names(args.modes, MODES) if args.modes else None
    args.time_modes = parse_names(args.time_modes, MODES) if args.time_modes else None
    args.rows = [int(t) for t in args.rows.split(",") if t.strip()] if args.rows else []
    return args


def modes_of(args, name: str) -> tuple[list[str], list[str]]:
    """(memory modes, time modes) of workload ``name``, less the peers that cannot run."""
    skip = dict(skipped_modes(args, name))
    modes = [m for m in args.modes or default_modes(name) if m not in skip]
    return modes, [m for m in args.time_modes or modes if m not in skip]


def skipped_modes(args, name: str) -> list[tuple[str, str]]:
    """(peer mode, why) for each requested peer mode that cannot run on workload ``name``:
    it computes another loss, or this torch has no ``F.linear_cross_entropy``."""
    asked = dict.fromkeys([*(args.modes or default_modes(name)), *(args.time_modes or [])])
    out = []
    for mode in (m for m in asked if m in baselines.PEERS):
        if mode not in baselines.peers_for(name):
            out.append((mode, f"computes only {', '.join(baselines.PEER_WORKLOADS)}'s loss"))
        elif why := baselines.peer_unavailable():
            out.append((mode, why))
    return out


def case_sizes(args, name: str, rows: int | None = None) -> tuple[int, int]:
    """(T, V) of a case: ``rows`` (one of --rows; in a child, the one it was given) and --vocab."""
    return sizes(name, args.scale, rows or (args.rows[0] if args.rows else None), args.vocab or None)


def parse_names(text: str, known) -> list[str]:
    """A comma list of names, each one of ``known`` (else exit naming the choices)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit(f"unknown name(s) {bad}; choose from {', '.join(known)}")
    return names


# --- child processes --------------------------------------------------------------

def memory_child(args) -> dict:
    """Peak extra memory of one step of (--case, --mode), after warm-up; and its errors."""
    from benchmarks.cases import errors, make_case, pass_report
    from benchmarks.memory import hwm, release, reset_peak, rss

    T, V = case_sizes(args, args.case)
    case = make_case(args.case, args.mode, T, V)
    for _ in range(args.warmup):
        out = case.step()
        del out
        case.clear_grads()
    release()
    before = rss()
    reset_peak()
    outputs, grads = case.step()  # the measured step: outputs and grads stay alive
    peak = hwm()
    result = {"peak_mib": (peak - before) / MIB, "rss_before_mib": before / MIB}
    result.update(pass_report(args.mode))
    result.update(errors(case, outputs, grads))
    return result


def _warm_up(args, case) -> dict:
    """Compile and warm up ``case``; what the compile did (see cases.pass_report)."""
    from benchmarks.cases import pass_report, snapshot
    before = snapshot()
    for _ in range(args.warmup):
        case.step()
        case.clear_grads()
    return pass_report(case.mode, before)


def _interleave(args, cases) -> dict:
    """Step times per mode, the modes taking turns: A, B, C, A, B, C ..."""
    times, clock = {c.mode: [] for c in cases}, CLOCKS[args.clock]
    for _ in range(args.steps):
        for case in cases:
            t0 = clock()
            case.step()
            times[case.mode].append(clock() - t0)
            case.clear_grads()
    return {m: {"t_min_ms": 1e3 * min(ts), "t_median_ms": 1e3 * statistics.median(ts),
                "n_time_steps": len(ts)} for m, ts in times.items()}


def time_child(args) -> dict:
    """Interleaved step times of every mode on shared inputs.  With --report (the memory
    runs, which compute them, were skipped) also the errors and what each compile did."""
    from benchmarks.cases import errors, make_case, make_inputs
    T, V = case_sizes(args, args.time)
    T = max(1, T // time_rows_div(args, args.time))
    inputs = make_inputs(args.time, T, V)
    cases, compiled, failed = [], {}, {}
    for mode in args.time_modes:
        case = make_case(args.time, mode, T, V, inputs)
        try:
            compiled[mode] = _warm_up(args, case)
        except Exception as e:  # a mode that cannot compile is reported, not fatal
            failed[mode] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        cases.append(case)
    result = _interleave(args, cases)
    if args.time in LM_HEAD_WORKLOADS:
        result["gemm_ms"] = gemm_ms(inputs, CLOCKS[args.clock])
    if args.report:
        for case in cases:
            result[case.mode].update(compiled[case.mode], **errors(case, *case.step()))
    return {**result, **failed}


def native_bf16_matmul() -> bool:
    """Does this CPU multiply bf16 matrices in hardware (AVX-512 BF16 or AMX)?  Without
    it a bf16 GEMM runs several times slower than an FP32 one."""
    import torch

    from fx_passes import compat
    return compat.cpu_matmul_in_hardware(torch.bfloat16)


def gemm_ms(inputs, clock=time.perf_counter, steps: int = 3) -> float:
    """Median time of one ``hidden @ weight.T`` of an lm_head workload (its two first
    inputs): the unit of the lm_head rows' time floor (see run_time)."""
    hidden, weight = inputs[0].detach(), inputs[1].detach()
    hidden = hidden.reshape(-1, hidden.shape[-1])
    times = []
    for _ in range(steps + 1):
        t0 = clock()
        hidden @ weight.T
        times.append(clock() - t0)
    return 1e3 * statistics.median(times[1:])


def time_rows_div(args, name: str) -> int:
    """What T of workload ``name`` is divided by for timing (see --time-rows-div)."""
    if name not in LM_HEAD_WORKLOADS:
        return 1
    return args.time_rows_div or (1 if native_bf16_matmul() else 8)


def cpu_line() -> str:
    """What the kernels of this run were built for: the step times depend on it."""
    import torch
    from torch._inductor import cpu_vec_isa
    isa = cpu_vec_isa.pick_vec_isa()
    return (f"cpu: ATen capability {torch.backends.cpu.get_cpu_capability()} "
            f"(ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', 'unset')}), Inductor vector ISA "
            f"{type(isa).__name__ if isa else 'none'} "
            f"(TORCHINDUCTOR_CPP_MARCH={os.environ.get('TORCHINDUCTOR_CPP_MARCH', 'unset')}), "
            f"native bf16 matmul: {'yes' if native_bf16_matmul() else 'no'} "
            f"(lm_head backward plan: {_plan()})")


def child_result(args) -> dict:
    """What a child process measures: one memory case (--case) or one timing (--time)."""
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    return memory_child(args) if args.case else time_child(args)


def child_main(args) -> None:
    from fx_passes.testing.workloads import set_mask
    set_mask(args.mask, args.mask_style)
    print(RESULT_TAG + json.dumps(child_result(args)), flush=True)


# --- parent -----------------------------------------------------------------------

def spawn(args, extra: list[str], env_extra: dict | None = None, rows: int | None = None) -> dict:
    """Run this script as a child with ``extra`` arguments (at T ``rows``, when given);
    its result dict or an error."""
    cmd = [sys.executable, __file__, *child_argv(args, extra, rows)]
    # the package's switches (CHUNKED_LOGITS=1 puts the pass into stock Inductor,
    # CHUNKED_LOGITS_DISABLE=1 takes it out of the backend) are kept away from the children
    env = without_ours(**(env_extra or {}))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    return {"error": f"exit {proc.returncode}: {_error_line(proc.stderr)}"}


def child_argv(args, extra: list[str], rows: int | None = None) -> list[str]:
    """The command line of a child: the parent's settings, the case's T, then ``extra``."""
    return ["--scale", str(args.scale), "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--threads", str(args.threads), "--vocab", str(args.vocab),
            "--mask", str(args.mask), "--mask-style", args.mask_style, "--clock", args.clock,
            *(["--rows", str(rows)] if rows else []), *extra]


def _error_line(stderr: str) -> str:
    """The exception line of a child's traceback (else its last line)."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()] or ["(no output)"]
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Failed|Interrupt)\b.*:", line):
            return line[:300]
    return lines[-1][:300]


def run_memory(args, name: str, t: int | None, rows: dict) -> None:
    T = case_sizes(args, name, t)[0]
    for mode in modes_of(args, name)[0]:
        t0 = time.time()
        res = spawn(args, ["--case", name, "--mode", mode], MALLOC_ENV, t)
        rows[(name, T, mode)].update(res)
        what = res.get("error") or f"peak {res['peak_mib']:.1f} MiB"
        print(f"  memory {name} {mode:<19} {what}  ({time.time() - t0:.0f} s)", flush=True)


def run_time(args, name: str, t: int | None, rows: dict) -> None:
    t0 = time.time()
    T = case_sizes(args, name, t)[0]
    time_modes = modes_of(args, name)[1]
    extra = ["--time", name, "--time-modes", ",".join(time_modes), "--time-rows-div",
             str(time_rows_div(args, name))]
    res = spawn(args, extra + (["--report"] if args.skip_memory else []), rows=t)
    if "error" in res and len(res) == 1:
        res = {m: dict(res) for m in time_modes}
    gemm = res.pop("gemm_ms", None)
    stock = res.get(STOCK, {}).get("t_median_ms")
    floor = time_floor_line(name, gemm, stock) if gemm and stock else None
    if floor:
        print(floor, flush=True)
    for mode, r in res.items():
        if stock and "t_median_ms" in r:
            r["t_ratio_vs_stock"] = r["t_median_ms"] / stock
        rows[(name, T, mode)].update(r, time_T=T // time_rows_div(args, name))
    print(f"  time   {name} all modes interleaved  ({time.time() - t0:.0f} s)", flush=True)


def time_floor_line(name: str, gemm: float, stock: float) -> str | None:
    """What the lm_head rows' time ratio cannot get much below on a CPU with bf16 units.
    Stock runs three ``[T, H] x [H, V]`` bf16 GEMMs (logits, grad_hidden, grad_weight).
    A backward that never stores the logits computes them again, and with bf16 GEMMs
    (each rounds its own output, so each must hold whole sums) it needs one pass whose
    GEMMs hold whole rows and one whose GEMMs hold whole vocabulary blocks: five in all
    (``tiling.backward_plan``); four when the loss is in the graph and the forward
    computes ``grad_hidden`` (``Config.gradients_in_forward``: W4, W4L, WV).  Elsewhere
    (FP32 GEMMs) no floor is printed."""
    if _plan() != "two_sweeps":
        return None
    return (f"  floor  {name}: one [T, H] x [H, V] bf16 GEMM {gemm:.0f} ms, stock's step {stock:.0f} ms "
            f"(3 GEMMs + {stock - 3 * gemm:.0f} ms); two_sweeps runs 4 with the gradients in the "
            f"forward (5 without), about {4 * gemm / stock:.2f}x ({5 * gemm / stock:.2f}x) stock's step "
            "in GEMMs alone")


def _plan() -> str:
    import torch

    from fx_passes.kernels.tiling import backward_plan
    return backward_plan(torch.device("cpu"), torch.bfloat16)


def source_version() -> str:
    """The commit, and a hash of every fx_passes/**/*.py as they are now (the tree may be edited)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted((root / "fx_passes").rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + path.read_bytes())
    try:
        commit = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    return f"commit {commit or '?'}, fx_passes sources {h.hexdigest()[:12]}"


def parent_main(args) -> None:
    import torch
    version = source_version()
    print(version, flush=True)
    print(cpu_line(), flush=True)
    threads = args.threads or torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, scale 1/{args.scale}, "
          f"{args.warmup} warm-up + {args.steps} timed steps per mode, {args.clock} clock", flush=True)
    rows: dict = {}
    for name in args.workloads:
        for mode, why in skipped_modes(args, name):
            print(f"{name}: {mode} skipped: {why}", flush=True)
        for t in args.rows or [None]:
            T, V = case_sizes(args, name, t)
            for mode in dict.fromkeys(sum(modes_of(args, name), [])):
                rows[(name, T, mode)] = {"workload": name, "mode": mode, "T": T, "V": V,
                                         "limit_mib": limit_bytes(name, T, V) / MIB}
            print(f"{name}: T={T} V={V}", flush=True)
            if not args.skip_memory:
                run_memory(args, name, t, rows)
            if not args.skip_time:
                run_time(args, name, t, rows)
            report.write_csv(list(rows.values()), args.csv)  # so far: a long sweep cut short keeps it
    report.finish(list(rows.values()), args.csv)
    if args.plot:
        plot.write_plot(args.csv)
    if source_version().split(", ")[-1] != version.split(", ")[-1]:  # (the sources, not a docs edit)
        print(f"WARNING: fx_passes changed during the run (now {source_version()}): rerun", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.case or args.time:
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
