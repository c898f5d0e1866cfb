"""One workload of the GPU check (benchmarks/gpu_check.py), in a process of its own.

    python benchmarks/gpu_case.py W3:2048:32768 --out bench_out/gpu --device cuda --guard 80

Compiles every mode on one set of inputs, then measures each mode's peak memory and
error against FP64, then times the modes interleaved (A, B, C, A, B, C ...), and
writes what it has to ``<out>/cases/<workload>.json`` after every phase.  On the GPU
the parent starts one process per workload, so that it can kill a case at its time
guard and still keep what the case wrote, and so that each case starts with a fresh
CUDA allocator; the dry run puts all workloads in one process (importing torch and
Inductor again for each would cost more than its tiny cases).

Without CUDA (the dry run) the same steps run on the CPU with stand-ins:
``VmHWM`` (benchmarks/memory.py) for ``torch.cuda.max_memory_allocated`` and
``time.perf_counter`` for CUDA events.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from unittest import mock

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import baselines, memory  # noqa: E402
from benchmarks.cases import (  # noqa: E402
    Case,
    ensure_backend,
    errors,
    limit_bytes,
    make_case,
    make_inputs,
    pass_report,
    reference,
    snapshot,
)
from benchmarks.gpu_report import write_json  # noqa: E402
from fx_passes.testing.codegen import full_fp32_buffers  # noqa: E402
from fx_passes.testing.workloads import ALL_WORKLOADS, on_device  # noqa: E402

STOCK = "inductor"
COMPILED = (STOCK, "chunked_logits", "chunked_logits_dyn")
CODE_WORKLOADS = ("W1", "W3", "W4")  # their generated code is saved and checked (issue 13)
LM_HEAD_OP = "torch.ops.chunked_logits.lm_head_stats"  # what a fused outer graph calls


def modes_for(name: str) -> list[str]:
    """Stock Inductor, ours static and dynamic, then the baselines that compute the workload."""
    return [*COMPILED, *baselines.applies_to(name)]


class Deadline:
    """The case's time guard: phases check it between steps and skip what is left."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def passed(self) -> bool:
        return time.monotonic() > self.end


# --- measuring: CUDA, or the CPU stand-ins of the dry run ---------------------------

def peak_bytes(step: Callable, device: torch.device):
    """(result of ``step()``, its peak allocation above what was allocated before it)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = step()
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - before
    memory.release()
    before = memory.rss()
    memory.reset_peak()
    out = step()
    return out, memory.hwm() - before


def step_seconds(step: Callable, device: torch.device) -> float:
    """Wall time of ``step()`` on the device: CUDA events, or perf_counter on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


# --- the phases ---------------------------------------------------------------------

def build_cases(name: str, T: int, V: int, device: torch.device, result: dict) -> dict[str, Case]:
    """A Case per mode on one shared set of inputs; baselines that cannot run get a
    row saying why (and a line on stdout)."""
    inputs = on_device(make_inputs(name, T, V), device)
    cases = {}
    result["rows"] = {mode: {} for mode in modes_for(name)}
    for mode in modes_for(name):
        if mode in COMPILED:
            cases[mode] = make_case(name, mode, T, V, inputs)
            continue
        why = baselines.unavailable(mode, device)
        if why:
            result["rows"][mode] = {"skipped": why}
            print(f"{name}: {mode} skipped: {why}", flush=True)
            continue
        fn = baselines.baseline_fn(mode, name)
        cases[mode] = Case(name, mode, T, V, ALL_WORKLOADS[name], fn, inputs)
    return cases


def check_code(case: Case, codes: list[str], out_dir: pathlib.Path) -> dict:
    """Save the generated code of one compile and look for FP32 [T, V] buffers.

    With the lm_head fused, only the outer graphs (those that call the op) are
    checked: the loop bodies are compiled with dynamic shapes for one row chunk or
    vocabulary block, so their chunk-sized FP32 buffers have symbolic sizes.
    """
    code_dir = out_dir / "code"
    code_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for i, code in enumerate(codes):
        path = code_dir / f"{case.name}_{case.mode}_{i}.py"
        path.write_text(code)
        files.append(str(path.relative_to(out_dir)))
    outer = [c for c in codes if LM_HEAD_OP in c]
    checked = outer if (case.mode != STOCK and outer) else codes
    return {"files": files, "checked_files": len(checked),
            "flagged": [list(d) for d in full_fp32_buffers(checked, case.T, case.V)]}


@contextlib.contextmanager
def generated_code():
    """Collects the code Inductor generates (or loads from its cache) inside the block.

    The hook ``torch._inductor.utils.run_and_get_code`` uses, without the
    ``torch._dynamo.reset()`` it starts with: that reset would throw away the modes
    compiled before, and compiling them again costs as much as the check itself on a
    cold CPU cache.
    """
    from torch._inductor.graph import GraphLowering
    codes: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        yield codes


def compile_phase(cases: dict, result: dict, out_dir: pathlib.Path, deadline: Deadline) -> None:
    """The first step of every mode, which compiles it; for W1, W3 and W4 with the
    generated code saved and checked."""
    for mode in list(cases):
        if deadline.passed():
            _note(result, f"time guard reached: {mode} not compiled, nor measured")
            del cases[mode]
            continue
        case, before, t0 = cases[mode], snapshot(), time.monotonic()
        row = result["rows"][mode]
        try:
            with generated_code() as codes:
                case.step()
            case.clear_grads()
        except Exception as e:  # noqa: BLE001  (a mode that fails is reported, the others go on)
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"{case.name}: {mode} failed: {row['error']}", flush=True)
            del cases[mode]
            continue
        row["compile_s"] = time.monotonic() - t0
        row.update(pass_report(mode, before))
        if case.name in CODE_WORKLOADS and mode in COMPILED:
            result["codegen"][mode] = check_code(case, codes, out_dir)


def warm_phase(cases: dict, warmup: int) -> None:
    for _ in range(warmup):
        for case in cases.values():
            case.step()
            case.clear_grads()


def memory_phase(cases: dict, result: dict, device: torch.device, deadline: Deadline) -> None:
    """Per mode: the peak of one step above what is allocated before it (inputs, and
    the FP64 reference, which is computed once for all modes), and its errors."""
    ref = reference(next(iter(cases.values())))
    for mode, case in cases.items():
        if deadline.passed():
            _note(result, f"time guard reached: memory of {mode} and later modes skipped")
            break
        (outputs, grads), peak = peak_bytes(case.step, device)
        row = result["rows"][mode]
        row["peak_mib"] = peak / memory.MIB
        row.update(errors(case, outputs, grads, ref))
        del outputs, grads
        case.clear_grads()


def time_phase(cases: dict, result: dict, device: torch.device, steps: int, deadline: Deadline) -> None:
    """Rounds of one step per mode; the guard may cut the rounds short (at least one)."""
    times: dict[str, list[float]] = {m: [] for m in cases}
    for i in range(steps):
        if i and deadline.passed():
            _note(result, f"time guard reached: {i} of {steps} timing rounds")
            break
        for mode, case in cases.items():
            times[mode].append(step_seconds(case.step, device))
            case.clear_grads()
    stock = statistics.median(times[STOCK]) if times.get(STOCK) else None
    for mode, ts in times.items():
        med = statistics.median(ts)
        result["rows"][mode].update(t_median_ms=1e3 * med, t_min_ms=1e3 * min(ts), n_time_steps=len(ts),
                                    t_ratio_vs_stock=med / stock if stock else None)


def _note(result: dict, line: str) -> None:
    """A line in the case's notes and on stdout (what was skipped, and why)."""
    result["notes"].append(line)
    print(f"{result['workload']}: {line}", flush=True)


# --- the process --------------------------------------------------------------------

def run_case(name: str, T: int, V: int, args) -> dict:
    """Every phase of one workload under its own guard; its JSON is rewritten after each."""
    t0, device, deadline = time.monotonic(), torch.device(args.device), Deadline(args.guard)
    result = {"workload": name, "T": T, "V": V, "device": str(device),
              "limit_mib": limit_bytes(name, T, V) / memory.MIB, "rows": {}, "codegen": {}, "notes": []}
    out_dir = pathlib.Path(args.out)
    path = out_dir / "cases" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    cases = build_cases(name, T, V, device, result)
    phases = [("compile", lambda: compile_phase(cases, result, out_dir, deadline)),
              ("warm-up", lambda: warm_phase(cases, args.warmup)),
              ("memory", lambda: memory_phase(cases, result, device, deadline)),
              ("timing", lambda: time_phase(cases, result, device, args.steps, deadline))]
    for phase, run in phases:
        if not cases:
            break
        if deadline.passed():
            _note(result, f"time guard ({args.guard:.0f} s) reached: {phase} and later phases skipped")
            break
        run()
        result["seconds"] = time.monotonic() - t0
        write_json(path, result)
    result["seconds"] = time.monotonic() - t0
    write_json(path, result)
    return result


def _spec(text: str) -> tuple[str, int, int]:
    """``W3:2048:32768`` -> ("W3", 2048, 32768)."""
    name, T, V = text.split(":")
    if name not in ALL_WORKLOADS:
        raise argparse.ArgumentTypeError(f"unknown workload {name!r}; choose from {', '.join(ALL_WORKLOADS)}")
    return name, int(T), int(V)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="+", type=_spec, metavar="NAME:T:V", help="workloads, run in this order")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=10, help="timing rounds")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps after the compiling one")
    p.add_argument("--guard", type=float, default=80, help="seconds per workload before its remaining "
                   "phases are skipped")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    ensure_backend()
    for name, T, V in args.cases:
        run_case(name, T, V, args)


if __name__ == "__main__":
    main()
