"""One case of the GPU check (benchmarks/gpu_check.py), in a process of its own.

    python benchmarks/gpu_case.py W4L:8192:151936:4096 --out bench_out/gpu --device cuda --guard 60

A case is a workload variant at one size (``CASES``: the lm_head losses in the graph and
per token, distillation, top-p, a vocab-parallel step on one rank, ``reduce-overhead``,
a cross-entropy with half its labels ignored) and its modes: stock Inductor first, then ours
with each lm_head plan a GPU runs (the masked case: ours, and ours running every row).  The
phases, each mode in turn and the guard checked between steps: compile (the first
step), warm-up, peak memory and error vs FP64, one step under
``torch.cuda.set_sync_debug_mode("error")``, one under the profiler (kernels, GEMM
time, host-sync ops), then timing rounds with the modes interleaved, and last one step
recording the GEMMs' FLOPs (a dispatch mode).  ``<out>/cases/<case>.json`` is rewritten after every phase.

Without CUDA (the dry run) the same phases run on the CPU with stand-ins: ``VmHWM``
for ``max_memory_allocated``, ``perf_counter`` for CUDA events, profiler ops for
kernels; the ``gpu`` plan runs on the test-only ``out_dtype`` kernels
(``fx_passes.testing.gemms.cpu_out_dtype_kernels``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import pathlib
import re
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Optional
from unittest import mock

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import memory  # noqa: E402
from benchmarks.cases import Case, _fresh, ensure_backend, errors, pass_report, reference, snapshot  # noqa: E402
from benchmarks.gpu_report import write_json  # noqa: E402
from fx_passes.kernels import tiling  # noqa: E402
from fx_passes.testing import gemms  # noqa: E402
from fx_passes.testing.workloads import (  # noqa: E402
    ALL_WORKLOADS,
    MASK,
    Workload,
    _make_lm_head,
    _make_lm_head_ce,
    row_mask,
)

STOCK = "inductor"
GPU_PLANS = ("gpu", "blocks", "two_sweeps")  # the lm_head plans a GPU runs (Config.lm_head_plan)
SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::equal", "aten::is_nonzero")
GEMM_KERNEL = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|triton_tem|matmul", re.I)
CPU_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_linear_pointwise")
COMPILE_SHARE = 0.6  # no mode starts compiling past this share of the guard: the rest measures
DRY_OPTIONS = {"chunk_budget_mib": 0.1}  # the dry run: two row chunks and vocabulary blocks
DRY_ALL_PLANS = "W4L"  # the dry run runs every plan on this case, the gpu plan on the others


# --- the workload variants ------------------------------------------------------------

def lm_head_logprob(hidden, weight, tokens):
    """W4's per-token log-probs: the graph returns them, the loss is computed outside."""
    logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def lm_head_ce_per_token(hidden, weight, labels):
    """WV's per-token cross-entropy (``reduction="none"``)."""
    return F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100, reduction="none")


def policy_loss_outside(hidden, weight, tokens, advantages, inner=lm_head_logprob):
    """W4's loss from a per-token graph ``inner`` (the loss is eager, outside it)."""
    return -(inner(hidden, weight, tokens) * advantages).mean()


def ce_outside(hidden, weight, labels, inner=lm_head_ce_per_token):
    """WV's mean cross-entropy from a per-token graph ``inner``."""
    return inner(hidden, weight, labels).sum() / (labels != -100).sum()


def vocab_parallel_loss(hidden, weight, tokens, advantages):
    """A policy loss written the Megatron way on this rank's shard (here the whole
    vocabulary: one rank), collectives on per-row tensors (examples/vocab_parallel_step.py)."""
    from examples.vocab_parallel_step import token_stats
    return -(token_stats(hidden @ weight.t(), tokens, 0, "logprob") * advantages).mean()


def lm_head_inputs(T: int, V: int, H: int, device: torch.device, labels: bool = False) -> tuple:
    """W4's inputs (hidden, weight, tokens, advantages), or WV's (hidden, weight, labels with
    10% ignored), drawn on ``device`` (at V 151936, H 4096 the CPU's generator takes seconds):
    the workloads' distributions (fx_passes/testing/workloads.py), not their numbers."""
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(T, H, generator=g, device=device).bfloat16().requires_grad_(True)
    weight = (torch.randn(V, H, generator=g, device=device) / H**0.5).bfloat16().requires_grad_(True)
    tokens = torch.randint(0, V, (T,), generator=g, device=device)
    if labels:
        tokens[torch.rand(T, generator=g, device=device) < 0.1] = -100
        return hidden, weight, tokens
    return hidden, weight, tokens, torch.randn(T, generator=g, device=device)


def distillation_inputs(T: int, V: int, H: int, device: torch.device) -> tuple:
    """WD's: the student's lm_head inputs, the teacher's bf16 logits near the student's."""
    hidden, weight, _, _ = lm_head_inputs(T, V, H, device)
    g = torch.Generator(device=device).manual_seed(1)
    noise = torch.randn(T, V, generator=g, device=device)
    return hidden, weight, (hidden.detach().float() @ weight.detach().float().T + noise).bfloat16()


def top_p_inputs(T: int, V: int, device: torch.device) -> tuple:
    """WP's: logits, each row's most likely token (every filter keeps it), advantages."""
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(T, V, generator=g, device=device) * 3).bfloat16().requires_grad_(True)
    return x, x.detach().float().argmax(dim=-1), torch.randn(T, generator=g, device=device)


@dataclasses.dataclass(frozen=True)
class CaseDef:
    """A case: its workload (inputs, reference), the function a mode compiles, its modes,
    and its cost-model row ((loss, loss in graph) or None where the model has none)."""

    workload: Workload
    modes: tuple[str, ...]
    inner: Optional[Callable] = None  # compiled instead of the workload's fn (per token)
    model: Optional[tuple[str, bool]] = None
    group: bool = False  # needs a one-rank process group
    masked: float = 0.0  # the share of rows the loss leaves out (the cost model's ``masked`` row)


_W4L, _WV = ALL_WORKLOADS["W4L"], ALL_WORKLOADS["WV"]
# (and the forward's logits kept for the backward, 3 GEMMs on stock's structure, the loss in
# the graph too: NOTE [kept logits]; what ``auto`` runs on a GPU for W4L and W4L-tok,
# ``tiling.keeps_logits``; ``gpu``, what it runs for WV and WV-tok and ``lm_head_plan="gpu"`` for all)
LM_MODES = (STOCK, *(f"ours:{p}" for p in GPU_PLANS), "ours:kept_logits")
CASES = {
    "W4L": CaseDef(_W4L, LM_MODES, model=("logprob", True)),
    "WV": CaseDef(_WV, LM_MODES, model=("ce", True)),
    "W4L-tok": CaseDef(Workload("W4L-tok", policy_loss_outside, True, _make_lm_head, _W4L.full_size, (0, 1)),
                       LM_MODES, inner=lm_head_logprob, model=("logprob", False)),
    "WV-tok": CaseDef(Workload("WV-tok", ce_outside, True, _make_lm_head_ce, _WV.full_size, (0, 1)),
                      LM_MODES, inner=lm_head_ce_per_token, model=("ce", False)),
    "RO": CaseDef(_WV, ("inductor:ro", "ours:ro")),
    "WD": CaseDef(ALL_WORKLOADS["WD"], (STOCK, "ours")),
    "WP": CaseDef(ALL_WORKLOADS["WP"], (STOCK, "ours")),
    # (``ours``: ``auto``, on CUDA the logits shard kept for the backward, NOTE [kept shard
    # logits], as ``kept_logits``; ``two_sweeps``, what the 2026-12-04 run ran)
    "VP": CaseDef(Workload("VP", vocab_parallel_loss, True, _make_lm_head, (4096, 32768), (0, 1)),
                  (STOCK, "ours", "ours:two_sweeps", "ours:gpu"), group=True),
    # WV's loss with the first half of each sequence's labels -100 (SFT prompts): ours skips
    # those rows after one host read a step; ``all_rows`` is ours with the option off, so the
    # read's cost and the rows' saving are both in one run (docs/how-it-works.md, 5c).
    "W4C": CaseDef(ALL_WORKLOADS["W4C"], (STOCK, "ours", "ours:all_rows"), model=("ce", True),
                   masked=MASK["fraction"]),
    # the per-token path's masked call (a masked-mean loss and entropy metric both leave the
    # graph): the same read in its forward, the count a host tensor for its backward
    "W4E": CaseDef(ALL_WORKLOADS["W4E"], (STOCK, "ours", "ours:all_rows"), masked=MASK["fraction"]),
    # the row-local engine's masked loss (WD's KL as a masked mean): the same read in
    # row_local_loss's forward, its gpu plan's backward reading nothing
    "WDM": CaseDef(ALL_WORKLOADS["WDM"], (STOCK, "ours", "ours:all_rows"), masked=MASK["fraction"]),
}
NOT_PLANS = {"ro", "all_rows"}  # the variants of a mode that are not an lm_head plan


def modes_of(key: str, dry_run: bool) -> tuple[str, ...]:
    """The case's modes; in the dry run the other plans only on ``DRY_ALL_PLANS`` (they
    differ in the backward only: a compile each, most of the dry run's time)."""
    modes = CASES[key].modes
    if dry_run and key != DRY_ALL_PLANS:
        plain = "ours" in modes  # (its auto mode runs there: no forced plan beside it)
        return tuple(m for m in modes if m.partition(":")[2] not in (*GPU_PLANS[1:], "kept_logits")
                     and not (plain and m == "ours:gpu"))
    return modes


def make_inputs(key: str, T: int, V: int, H: int, device: torch.device) -> tuple:
    name = CASES[key].workload.name
    if name == "WD":
        return distillation_inputs(T, V, H, device)
    if name == "WP":
        return top_p_inputs(T, V, device)
    if name == "W4C":
        hidden, weight, labels = lm_head_inputs(T, V, H, device, labels=True)
        return hidden, weight, torch.where(row_mask(T).to(device), labels, -100)
    if name == "W4E":
        return (*lm_head_inputs(T, V, H, device), row_mask(T).float().to(device))
    if name == "WDM":
        return (*distillation_inputs(T, V, H, device), row_mask(T).float().to(device))
    return lm_head_inputs(T, V, H, device, labels=name in ("WV", "WV-tok"))


def compile_mode(fn: Callable, mode: str, dry_run: bool) -> Callable:
    """``inductor`` / ``ours`` (auto plan) / ``ours:<plan>``, ``:ro`` for
    ``mode="reduce-overhead"`` (which takes no options: the auto plan).  The dry run
    forces the ``gpu`` plan where a mode leaves it to the device, and a small budget
    (for ``ours:ro`` through ``options["inductor"]``, the settings ``mode=`` gives)."""
    base, _, variant = mode.partition(":")
    f = _fresh(fn)
    backend = STOCK if base == STOCK else "chunked_logits"
    if variant == "ro" and not (dry_run and backend != STOCK):
        return torch.compile(f, backend=backend, mode="reduce-overhead")
    if variant == "ro":  # what mode= does (entry/backend.py settings), with the gpu plan forced
        ro = torch._inductor.list_mode_options("reduce-overhead")
        options = {**DRY_OPTIONS, "lm_head_plan": "gpu", "inductor": ro}
        return torch.compile(f, backend=backend, options=options)
    if backend == STOCK:
        return torch.compile(f, backend=STOCK)
    options = {**DRY_OPTIONS, "lm_head_plan": "gpu"} if dry_run else {}
    if variant == "all_rows":
        options["skip_masked_rows"] = False
    elif variant:
        options["lm_head_plan"] = variant
    return torch.compile(f, backend=backend, options=options or None)


class RoCase(Case):
    """A ``reduce-overhead`` step: a new step begins for the CUDA-graph trees each time."""

    def step(self):
        torch.compiler.cudagraph_mark_step_begin()
        return super().step()


def build_case(key: str, mode: str, T: int, V: int, inputs: tuple, dry_run: bool) -> Case:
    d = CASES[key]
    compiled = compile_mode(d.inner or d.workload.fn, mode, dry_run)
    fn = functools.partial(d.workload.fn, inner=compiled) if d.inner else compiled
    cls = RoCase if mode.endswith(":ro") else Case
    return cls(key, mode, T, V, d.workload, fn, inputs)


class Deadline:
    """The case's time guard: phases check it between steps and skip what is left."""

    def __init__(self, seconds: float):
        self.start, self.seconds = time.monotonic(), seconds

    def passed(self, share: float = 1.0) -> bool:
        """Past ``share`` of the guard."""
        return time.monotonic() > self.start + share * self.seconds


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


@contextlib.contextmanager
def graph_replays():
    """Counts ``torch.cuda.CUDAGraph.replay`` calls inside the block (``[n]``): the
    CUDA-graph trees of ``reduce-overhead`` replay through it."""
    n = [0]
    cls = getattr(torch.cuda, "CUDAGraph", None)
    if cls is None or not torch.cuda.is_available():
        yield n
        return
    original = cls.replay

    def replay(self, *args, **kwargs):
        n[0] += 1
        return original(self, *args, **kwargs)
    with mock.patch.object(cls, "replay", replay):
        yield n


def sync_site(stack: traceback.StackSummary) -> str:
    """Where a host sync came from: the innermost frame of this repository or of
    Inductor's generated code (``file:line``), else the innermost frame."""
    for frame in reversed(stack):
        name = frame.filename
        if (name.startswith(str(ROOT)) and "/benchmarks/" not in name) or "torchinductor" in name:
            where = name[len(str(ROOT)) + 1:] if name.startswith(str(ROOT)) else pathlib.Path(name).name
            return f"{where}:{frame.lineno} {frame.name}"
    outer = [f for f in stack if not f.filename.endswith("warnings.py")]
    return f"{pathlib.Path(outer[-1].filename).name}:{outer[-1].lineno} {outer[-1].name}" if outer else "?"


def sync_checked(step: Callable, device: torch.device) -> str:
    """``"ok"``, or each host sync of one step run under ``set_sync_debug_mode("warn")``
    with where it came from (``SYNC x2: kernels/rows.py:88 select``); on the CPU
    ``"n/a (CPU)"``: the profiler's ops say it."""
    if device.type != "cuda":
        return "n/a (CPU)"
    sites: list[str] = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" in str(message):
            sites.append(sync_site(traceback.extract_stack()[:-1]))

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        original, warnings.showwarning = warnings.showwarning, show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = original
            torch.cuda.synchronize()
    if not sites:
        return "ok"
    return f"SYNC x{len(sites)}: " + "; ".join(dict.fromkeys(sites))


def timeline(kernels: list[tuple[str, float, float]], is_gemm: Callable[[str], bool], top: int = 4) -> dict:
    """Where a profiled step's device time went, from its kernels' ``(name, start us, end
    us)``: ``span_ms`` from the first kernel's start to the last one's end, ``busy_ms`` the
    union of their intervals (overlapping kernels count once), ``idle_ms`` the rest of the
    span (the device waiting on the host: launches, allocations, host reads), ``gemm_ms``,
    ``copy_ms`` (memsets and copies), ``other_ms`` (every other kernel: Inductor's row and
    elementwise kernels) and ``top_kernels``: the ``top`` non-GEMM, non-copy kernel names
    by their total time, ``[name, launches, ms]``.  The question a run answers with it:
    how much of a step outside its GEMMs is kernels, and how much the device waits
    (docs/gpu.md, "What to look at first on a GPU")."""
    if not kernels:
        return {}
    busy, end, spans = 0.0, -math.inf, sorted((s, e) for _, s, e in kernels)
    for s, e in spans:  # (the union of the intervals, in start order)
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    by = {"gemm": 0.0, "copy": 0.0, "other": 0.0}
    others: dict[str, list] = {}
    for name, s, e in kernels:
        kind = "gemm" if is_gemm(name) else "copy" if name.startswith(("Memcpy", "Memset")) else "other"
        by[kind] += e - s
        if kind == "other":
            acc = others.setdefault(name[:80], [name[:80], 0, 0.0])
            acc[1], acc[2] = acc[1] + 1, acc[2] + (e - s) / 1e3
    span = end - spans[0][0]
    biggest = sorted(others.values(), key=lambda a: -a[2])[:top]
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
            "gemm_ms": by["gemm"] / 1e3, "copy_ms": by["copy"] / 1e3, "other_ms": by["other"] / 1e3,
            "top_kernels": [[n, k, round(ms, 3)] for n, k, ms in biggest]}


def profiled(step: Callable, device: torch.device) -> dict:
    """Kernels launched, GEMM kernel time (ms), host-sync ops and the step's ``timeline``
    of one step.  On the CPU the stand-ins: ATen ops called, the GEMM ops' CPU time, the
    timeline of the top-level ATen ops."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, with_flops=True) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    syncs = sorted({e.name for e in events if e.name in SYNC_OPS})
    flops = {"prof_tflop": sum(e.flops or 0 for e in events) / 1e12}  # (the profiler's count: mm, addmm, bmm)
    if device.type == "cuda":
        on_gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                  and not getattr(e, "is_user_annotation", False)]  # (record_function ranges on the GPU)
        kernels = [e for e in on_gpu if not e.name.startswith(("Memcpy", "Memset"))]
        gemm_us = sum(e.time_range.elapsed_us() for e in kernels if GEMM_KERNEL.search(e.name))
        spans = [(e.name, e.time_range.start, e.time_range.end) for e in on_gpu]
        return {**timeline(spans, lambda n: bool(GEMM_KERNEL.search(n))), "kernels": len(kernels),
                "gemm_ms": gemm_us / 1e3, "syncs": syncs, **flops}
    ops = [e for e in events if e.name.startswith("aten::")]
    gemm_us = sum(e.cpu_time_total for e in ops if e.name in CPU_GEMM_OPS)
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in ops if e.cpu_parent is None]
    gemm_like = CPU_GEMM_OPS + ("aten::linear", "aten::matmul")  # (top-level ops calling a GEMM)
    return {**timeline(spans, lambda n: n in gemm_like), "kernels": len(ops), "gemm_ms": gemm_us / 1e3,
            "syncs": syncs, **flops}


def gemm_flops(step: Callable) -> float:
    """The FLOPs of the matmuls one step runs (``fx_passes.testing.gemms.recording``;
    a CUDA-graph replay runs none through ATen: 0, and the profiler's count is used)."""
    with gemms.recording() as rec:
        step()
    return float(sum(g.flops for g in rec))


# --- the phases ---------------------------------------------------------------------

def _each(cases: dict, result: dict, deadline: Deadline, phase: str, share: float = 1.0):
    """The modes in turn while ``share`` of the guard lasts (a line names those skipped)."""
    for mode in list(cases):
        if deadline.passed(share):
            _note(result, f"time guard reached: {phase} of {mode} and later modes skipped")
            if phase == "compile":  # (not compiled: not measured either)
                for later in list(cases)[list(cases).index(mode):]:
                    del cases[later]
            return
        yield mode, cases[mode], result["rows"][mode]


def _failed(cases: dict, mode: str, row: dict, phase: str, e: BaseException) -> None:
    row["error"] = f"{phase}: {type(e).__name__}: {e}"[:300]
    print(f"{mode} failed in {phase}: {row['error']}\n{traceback.format_exc()[-1500:]}", flush=True)
    del cases[mode]


def compile_phase(cases, result, deadline, args) -> None:
    from torch._dynamo.utils import counters
    for mode, case, row in _each(cases, result, deadline, "compile", COMPILE_SHARE):
        before, t0 = snapshot(), time.monotonic()
        cg = dict(counters["inductor"])
        try:
            case.step()
            case.clear_grads()
        except Exception as e:  # noqa: BLE001  (a mode that fails is reported, the others go on)
            _failed(cases, mode, row, "compile", e)
            continue
        row["compile_s"] = time.monotonic() - t0
        row.update(pass_report("chunked_logits" if mode.startswith("ours") else STOCK, before))
        if mode.endswith(":ro"):
            row["cudagraph"] = {k: v - cg.get(k, 0) for k, v in counters["inductor"].items()
                                if k.startswith("cudagraph") and v - cg.get(k, 0)}


def warm_phase(cases, result, deadline, args) -> None:
    for _ in range(args.warmup):
        for mode, case, row in _each(cases, result, deadline, "warm-up"):
            try:
                case.step()
                case.clear_grads()
            except Exception as e:  # noqa: BLE001
                _failed(cases, mode, row, "warm-up", e)


def memory_phase(cases, result, deadline, args) -> None:
    """Per mode: the peak of one step above what is allocated before it, its errors
    vs the FP64 reference (computed once for all modes)."""
    if not cases:
        return
    device = torch.device(args.device)
    try:
        ref = reference(next(iter(cases.values())))
    except Exception as e:  # noqa: BLE001 (e.g. FP64 out of memory: the peaks are still measured)
        ref = None
        _note(result, f"FP64 reference failed, errors not measured: {type(e).__name__}: {e}"[:300])
    for mode, case, row in _each(cases, result, deadline, "memory"):
        try:
            (outputs, grads), peak = peak_bytes(case.step, device)
            row["peak_mib"] = peak / memory.MIB
            if ref is not None:
                row.update(errors(case, outputs, grads, ref))
            del outputs, grads
        except Exception as e:  # noqa: BLE001
            _failed(cases, mode, row, "memory", e)
        case.clear_grads()
    del ref
    if device.type == "cuda":
        torch.cuda.empty_cache()


def inspect_phase(cases, result, deadline, args) -> None:
    """Per mode: a step under the sync debug mode, and a profiled one."""
    device = torch.device(args.device)
    for mode, case, row in _each(cases, result, deadline, "sync/profile"):
        checks = {"sync_mode": lambda: {"sync_mode": sync_checked(case.step, device)},
                  "profile": lambda: profiled(case.step, device)}
        _checks(case, row, checks)


def flops_phase(cases, result, deadline, args) -> None:
    """Per mode: a step recording its GEMMs (a dispatch mode: last, after the timing,
    since a chunk body that recompiles under it and fails runs eagerly from then on),
    then GEMM FLOPs over the profiled GEMM time."""
    for mode, case, row in _each(cases, result, deadline, "GEMM recording"):
        _checks(case, row, {"gemm_tflop": lambda: {"gemm_tflop": gemm_flops(case.step) / 1e12}})
        tflop = row.get("gemm_tflop") or row.get("prof_tflop")  # (the recording, or the profiler's)
        if tflop and row.get("gemm_ms"):
            row["gemm_tflops"] = tflop / (row["gemm_ms"] / 1e3)


def _checks(case: Case, row: dict, checks: dict) -> None:
    """Each check's fields into ``row``; one that fails is a line there, the mode goes on."""
    for what, check in checks.items():
        try:
            row.update(check())
        except Exception as e:  # noqa: BLE001
            row.setdefault("check_errors", []).append(f"{what}: {type(e).__name__}: {e}"[:200])
        case.clear_grads()


def time_phase(cases, result, deadline, args) -> None:
    """Rounds of one step per mode (interleaved); the guard may cut the rounds short."""
    device = torch.device(args.device)
    times: dict[str, list[float]] = {m: [] for m in cases}
    replays = {m: 0 for m in cases}
    for i in range(args.steps):
        if i and deadline.passed():
            _note(result, f"time guard reached: {i} of {args.steps} timing rounds")
            break
        for mode, case in cases.items():
            with graph_replays() as n:
                times[mode].append(step_seconds(case.step, device))
            replays[mode] += n[0]
            case.clear_grads()
    stock = next((statistics.median(ts) for m, ts in times.items() if m.startswith(STOCK) and ts), None)
    for mode, ts in times.items():
        if not ts:
            continue
        med = statistics.median(ts)
        row = result["rows"][mode]
        row.update(t_median_ms=1e3 * med, t_min_ms=1e3 * min(ts), n_time_steps=len(ts),
                   t_ratio_vs_stock=med / stock if stock else None)
        if mode.endswith(":ro"):
            row["replays"] = replays[mode]


def _note(result: dict, line: str) -> None:
    """A line in the case's notes and on stdout (what was skipped, and why)."""
    result["notes"].append(line)
    print(f"{result['case']}: {line}", flush=True)


# WV's labels (and so RO's, WV-tok's) are 10% ignored (``lm_head_inputs``): the loops that
# leave masked rows out run the others, after one host read
IGNORED = {"WV": 0.1, "WV-tok": 0.1, "RO": 0.1}


def predicted(key: str, mode: str, T: int, V: int, H: int) -> Optional[dict]:
    """The cost model's H200 step time (ms) of this row and its ratio to stock's, or
    None where the model has no such row (benchmarks/cost_model.py): the loops the row
    runs as built (``as_built``); VP: ``cost_loops.vocab_parallel``."""
    model = {"RO": ("ce", True), "VP": ("logprob", False)}.get(key, CASES[key].model)
    if model is None:
        return None
    from benchmarks import cost_loops as loops
    from benchmarks import cost_roofline as roof
    loss, in_graph = model
    dev = roof.DEVICES[-1]
    stock = loops.stock_vocab_parallel(T, H, V) if key == "VP" else loops.stock(T, H, V, loss)
    base, budget = roof.step_time(stock, dev), roof.device_budget(dev)
    if mode.startswith(STOCK):
        return {"ms": 1e3 * base, "ratio": 1.0, "device": dev.name}
    variant = mode.partition(":")[2]
    # ("auto" on a GPU: VP's one-pass loop keeps its logits shard, tiling.keeps_logits; RO, W4C:
    # a cross-entropy, the recomputing loops)
    auto = "kept_logits" if key == "VP" and tiling.keeps_logits("cuda", True) else "gpu"
    plan = auto if variant in ("", *NOT_PLANS) else variant
    if key == "VP":
        ours = roof.step_time(loops.vocab_parallel(budget, T, H, V, plan), dev)
    else:
        ks, host = as_built(key, variant, plan, loss, in_graph, T, V, H, budget)
        ours = roof.step_time(ks, dev) + host
    return {"ms": 1e3 * ours, "ratio": ours / base, "device": dev.name}


def as_built(key: str, variant: str, plan: str, loss: str, in_graph: bool, T: int, V: int, H: int,
             budget: int) -> tuple[list, float]:
    """``cost_loops.as_built`` for the case's row: its masked share (``all_rows``: none; WV's
    ignored labels), RO's replays."""
    from benchmarks import cost_loops as loops
    fraction = 0.0 if variant == "all_rows" else CASES[key].masked or IGNORED.get(key, 0.0)
    return loops.as_built(T, H, V, plan, loss, in_graph, budget, fraction, replay=key == "RO")


# --- the process --------------------------------------------------------------------

PHASES = (("compile", compile_phase), ("warm-up", warm_phase), ("memory", memory_phase),
          ("sync/profile", inspect_phase), ("timing", time_phase), ("GEMM recording", flops_phase))


def run_case(key: str, T: int, V: int, H: int, args) -> dict:
    """Every phase of one case under its own guard; its JSON is rewritten after each."""
    t0, device, deadline = time.monotonic(), torch.device(args.device), Deadline(args.guard)
    d = CASES[key]
    result = {"case": key, "workload": d.workload.name, "T": T, "V": V, "H": H, "device": str(device),
              "rows": {m: {} for m in modes_of(key, args.dry_run)}, "notes": []}
    path = pathlib.Path(args.out) / "cases" / f"{key}_{T}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    for mode in result["rows"]:
        try:
            result["rows"][mode]["predicted"] = predicted(key, mode, T, V, H)
        except Exception as e:  # noqa: BLE001 (a model that fails is a line, not the end of the case)
            result["rows"][mode]["predicted"] = None
            _note(result, f"no prediction for {mode}: {type(e).__name__}: {e}"[:200])
    write_json(path, result)
    try:
        inputs = make_inputs(key, T, V, H, device)
        cases = {m: build_case(key, m, T, V, inputs, args.dry_run) for m in result["rows"]}
    except Exception as e:  # noqa: BLE001
        _note(result, f"inputs failed: {type(e).__name__}: {e}"[:300])
        cases = {}
    for phase, run in PHASES:
        if not cases:
            break
        if deadline.passed():
            _note(result, f"time guard ({args.guard:.0f} s) reached: {phase} and later phases skipped")
            break
        run(cases, result, deadline, args)
        result["seconds"] = time.monotonic() - t0
        write_json(path, result)
    result["seconds"] = time.monotonic() - t0
    write_json(path, result)
    return result


@contextlib.contextmanager
def one_rank_group(device: torch.device):
    """A one-rank process group (NCCL on CUDA, gloo on the CPU) for the vocab-parallel case."""
    import torch.distributed as dist
    if dist.is_initialized():
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def spec(text: str) -> tuple[str, int, int, int, Optional[float]]:
    """``W4L:8192:151936:4096[:55]`` -> ("W4L", 8192, 151936, 4096, 55.0): its guard in
    seconds last (None: ``--guard``)."""
    key, T, V, H, *guard = text.split(":")
    if key not in CASES:
        raise argparse.ArgumentTypeError(f"unknown case {key!r}; choose from {', '.join(CASES)}")
    return key, int(T), int(V), int(H), float(guard[0]) if guard else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="+", type=spec, metavar="CASE:T:V:H[:GUARD]", help="cases, in this order")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true", help="force the gpu plan (CPU out_dtype kernels)")
    p.add_argument("--steps", type=int, default=10, help="timing rounds")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps after the compiling one")
    p.add_argument("--guard", type=float, default=60, help="seconds per case before its remaining "
                   "phases are skipped")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    ensure_backend()
    device = torch.device(args.device)
    with contextlib.ExitStack() as stack:
        if device.type == "cpu":
            stack.enter_context(gemms.cpu_out_dtype_kernels())
        if any(CASES[key].group for key, *_ in args.cases):
            stack.enter_context(one_rank_group(device))
        for key, T, V, H, guard in args.cases:
            guard = args.guard if guard is None else guard
            run_case(key, T, V, H, argparse.Namespace(**{**vars(args), "guard": guard}))


if __name__ == "__main__":
    main()
