"""Predicted step time of stock Inductor and of chunked_logits on H100 / H200 (issue 22, item 5).

    .venv/bin/python benchmarks/cost_model.py                  # the H100 / H200 table
    .venv/bin/python benchmarks/cost_calibrate.py --calibrate  # this CPU's rates: predicted vs measured
    .venv/bin/python benchmarks/cost_calibrate.py --audit      # the modelled GEMMs vs a recording
    .venv/bin/python benchmarks/cost_measured.py               # vs the recorded H200 run
    .venv/bin/python benchmarks/cost_model.py --memory         # predicted peaks (cost_memory.py)

A prediction, not a measurement.  Each step is a list of kernels; a kernel takes
``max(GEMM FLOPs / rate(input dtype), bytes / bandwidth, exps / exp rate)`` (a roofline
per kernel) plus a launch overhead, and a step the sum over its kernels.  The kernels:

* stock Inductor: its generated code (read on the CPU at small size; assumed the same
  kernels in Triton): the ``[T, H] x [H, V]`` GEMMs (3 with the lm_head in the graph), the
  forward's row reduction over the model-precision logits, and the backward's row
  kernel.  For the token log-probs (W3, W4, W4L) the backward zero-fills an FP32
  ``[T, V]`` buffer (the gather's gradient), then reads it and the logits and writes
  the model-precision gradient; for cross-entropy (WV) it reads the logits and writes
  the gradient.
* chunked_logits: W3 reads the logits in the forward and reads them and writes their
  gradient in the backward.  With the lm_head fused, the loops of
  ``fx_passes/kernels/log_softmax/lm_head.py``, ``lm_head_sweeps.py`` and ``gpu_plan.py`` at the
  device's chunk budget
  (``kernels.tiling``'s sizes): per chunk or block a GEMM that writes the logits tile,
  a body that reads it (and writes its gradient in the backward), the gradient GEMMs,
  the FP32 accumulators they read and write, and the FP32 copies of ``fp32_tiles`` /
  ``blocks``.  ``gradients_in_forward`` (the loss in the graph): ``fx_passes/kernels/log_softmax/loss.py``,
  row chunks that also form the gradient tile and write ``grad_hidden`` in one GEMM,
  then on ``gpu`` each chunk's ``grad_weight`` added into an FP32 ``[V, H]`` buffer
  (``out_dtype``; 3 GEMMs), on ``two_sweeps`` a vocabulary sweep in the backward
  (4 GEMMs; the incoming gradient 1, as ``loss.backward()`` gives it).

A GEMM moves its operands and its output once (an accumulating one reads its output
too); an elementwise kernel its inputs and outputs once (a row's several passes inside
one kernel hit the cache).  On a CPU a buffer over 32 MiB is mapped fresh every step and
its pages fault in at its first write (``Device.first_touch``); a GPU's caching
allocator reuses its blocks.  ``--calibrate`` measures this CPU's rates (GEMMs, copy,
an Inductor exp pass, first touch) and sets the predicted ratios of W3 and W4 beside
``run.py``'s measured ones (docs/gpu.md, "Predicted").  ``--audit`` compiles W4 and WV at small size with each
plan forced and compares the recorded GEMMs (``fx_passes.testing.gemms``) with the
modelled ones.  Both live in ``benchmarks/cost_calibrate.py``, which imports this module
(this one imports only ``cost_roofline.py``, a kernel's time, and ``cost_loops.py``, the
kernels of each path).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cost_loops import (  # noqa: E402
    GIF,
    SYNC_S,
    Build,
    as_built,
    masked,
    ours,
    stock,
    stock_vocab_parallel,
    vocab_parallel,
)
from benchmarks.cost_roofline import (  # noqa: E402
    BF16,
    DEVICES,
    FP32,
    GB,
    MIB,
    Device,
    device_budget,
    full_gemms,
    gemm,
    kernel_time,
    moved_bytes,
    step_time,
)
from fx_passes.kernels import tiling  # noqa: E402

H_LM = 1024  # H of W4, W4L and WV (fx_passes/testing/workloads.py, _make_lm_head)
WORKLOADS = {  # name: (T, H or 0 when the logits are an input, V, loss)
    "W3": (2048, 0, 32768, "logprob"),
    "W4": (4096, H_LM, 32768, "logprob"),
    "W4L": (16384, H_LM, 32768, "logprob"),
    "WV": (4096, H_LM, 151936, "ce"),
    "W4L-8k": (8192, 4096, 151936, "logprob"),  # the H200 run's sizes (benchmarks/gpu_runs/2026-12-04)
    "WV-8k": (8192, 4096, 151936, "ce"),
}
PLANS = ("gpu", "blocks", "two_sweeps", "fp32_tiles", "kept_logits")  # the lm_head backward plans modelled
# Issue 22's targets, on the H200, for the "gpu" plan: (workload, gradients in forward) -> bound
TARGETS = {("W4", True): 0.9, ("WV", True): 0.9, ("W4", False): 1.05, ("WV", False): 1.05,
           # issue 54's, at the H200 run's sizes
           ("W4L-8k", True): 0.95, ("WV-8k", True): 0.95, ("W4L-8k", False): 1.15, ("WV-8k", False): 1.15}


def masked_table(fractions: list[float], dev: Optional[Device] = None) -> str:
    """Ours / stock, cross-entropy with the lm_head in the graph (``gpu`` plan, the
    device's budget) at T 16384, H 4096, V 151936 on ``dev`` (the H200), by the share of
    rows the loss leaves out (stock computes every row)."""
    dev = dev or DEVICES[-1]
    T, H, V = BUDGET_SHAPE
    base, budget = step_time(stock(T, H, V, "ce"), dev), device_budget(dev)
    every = step_time(ours(T, H, V, "gpu", True, budget), dev) / base
    lines = [f"{dev.name}, T {T}, H {H}, V {V}, plan gpu, loss in graph, ours / stock (every row: "
             f"{every:.2f}x; a host read priced {SYNC_S * 1e6:.0f} us):", "",
             "| rows masked | ours / stock | full GEMMs (stock 3) |", "| --- | --- | --- |"]
    for f in fractions:
        ks = masked(T, H, V, "gpu", budget, f)
        ratio = (step_time(ks, dev) + SYNC_S) / base
        lines.append(f"| {f:.0%} | {ratio:.2f}x | {full_gemms(ks, T, H, V):.2f} |")
    return "\n".join(lines)


BUDGET_SHAPE = (16384, 4096, 151936)  # (T, H, V) of issue 35's budget table


def budget_table(budgets_mib: Optional[list[float]] = None, dev: Optional[Device] = None) -> str:
    """Ours / stock (cross-entropy with the lm_head in the graph, the ``gpu`` plan) at T
    16384, H 4096, V 151936 on ``dev`` (the H200): the loss in the graph and per-token,
    at the device's default budget and at smaller user-set ones."""
    dev = dev or DEVICES[-1]
    T, H, V = BUDGET_SHAPE
    default = device_budget(dev)
    budgets = [default] + [int(m * MIB) for m in (budgets_mib or [1024, 512, 256, 128, 32])]
    base = step_time(stock(T, H, V, "ce"), dev)
    lines = [f"{dev.name}, T {T}, H {H}, V {V}, plan gpu, ours / stock:", "",
             "| budget | loss loop rows | per-token forward rows | loss in graph | per-token |",
             "| --- | --- | --- | --- | --- |"]
    for b in budgets:
        gif, per = (step_time(ours(T, H, V, "gpu", g, b, Build(by_device=b == default)), dev) / base
                    for g in (True, False))
        name = f"{b / MIB:.0f} MiB" + (" (default)" if b == default else "")
        rows = tiling.gpu_loss_rows(b, T, V, b == default)
        lines.append(f"| {name} | {rows} | {tiling.forward_rows(b, T, V)} | {gif:.2f}x | {per:.2f}x |")
    return "\n".join(lines)


# --- the table --------------------------------------------------------------------------

def parse_plans(text: Optional[str], available: Optional[tuple] = None) -> tuple[list[str], list[str]]:
    """(plans to model, notes): ``text`` a comma list (None: all modelled); a plan this
    checkout's ``Config`` does not know (``available``) is left out with a note."""
    names = [p.strip() for p in (text or ",".join(PLANS)).split(",") if p.strip()]
    unknown = [p for p in names if p not in PLANS]
    if unknown:
        raise ValueError(f"unknown plan(s) {unknown}: the cost model has {', '.join(PLANS)}")
    if available is None:
        try:
            from fx_passes.config import LM_HEAD_PLANS as available
        except ImportError:
            available = PLANS
    notes = [f"plan {p!r}: not in this checkout's Config.lm_head_plan, left out" for p in names
             if p not in available]
    return [p for p in names if p in available], notes


def cases(plans: list[str]) -> list[tuple[str, Optional[str], bool]]:
    """(workload, plan or None for W3, gradients in forward) of each table row."""
    out = [("W3", None, False)]
    for name in ("W4", "W4L", "WV", "W4L-8k", "WV-8k"):
        for plan in plans:
            if plan in GIF:
                out.append((name, plan, True))
            out.append((name, plan, False))
    return out


def predict(devices, plans: list[str]) -> list[dict]:
    """A row per case: each device's stock and ours (ms) and ratio, GEMMs, GB moved, the
    target and whether it is met (on the last device); ``error`` where a plan's sizes
    cannot be computed on this checkout (the other rows stand)."""
    rows = []
    for name, plan, in_forward in cases(plans):
        T, H, V, loss = WORKLOADS[name]
        row = {"workload": name, "plan": plan or "-", "path": _path(H, in_forward, plan)}
        base = stock(T, H, V, loss)
        try:
            for dev in devices:
                ks = ours(T, H, V, plan, in_forward, device_budget(dev))
                row[dev.name] = {"stock_ms": 1e3 * step_time(base, dev), "ours_ms": 1e3 * step_time(ks, dev)}
                row[dev.name]["ratio"] = row[dev.name]["ours_ms"] / row[dev.name]["stock_ms"]
        except (AttributeError, TypeError, ValueError) as e:  # e.g. a tiling function this checkout lacks
            rows.append({**row, "error": f"{type(e).__name__}: {e}", "target": None, "met": None})
            continue
        row["gemms"] = (full_gemms(ks, T, H, V, BF16), full_gemms(ks, T, H, V, FP32)) if H else (0.0, 0.0)
        row["gb"] = (moved_bytes(base) / GB, moved_bytes(ks) / GB)
        bound = TARGETS.get((name, in_forward)) if plan in ("gpu", "kept_logits") else None
        row["target"] = bound
        row["met"] = None if bound is None else row[devices[-1].name]["ratio"] <= bound
        rows.append(row)
    return rows


def _path(H: int, in_forward: bool, plan: Optional[str] = None) -> str:
    if not H:
        return "row_stats"
    if in_forward:
        return "loss in graph: kept logits" if plan == "kept_logits" else "loss in graph: grads in forward"
    return "per-token: kept logits" if plan == "kept_logits" else "per-token: recompute"


def table(rows: list[dict], devices) -> str:
    names = [d.name for d in devices]
    head = ["workload", "plan", "path", "GEMMs bf16 / fp32", "GB stock / ours"]
    head += [f"{n} stock / ours ms" for n in names] + [f"{n} ratio" for n in names] + ["target", ""]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        if "error" in r:
            cells = [r["workload"], r["plan"], r["path"], f"not modelled: {r['error']}"]
            lines.append("| " + " | ".join(cells + [""] * (len(head) - 4)) + " |")
            continue
        cells = [r["workload"], r["plan"], r["path"], "%.2f / %.2f" % r["gemms"], "%.1f / %.1f" % r["gb"]]
        cells += ["%.2f / %.2f" % (r[n]["stock_ms"], r[n]["ours_ms"]) for n in names]
        cells += ["%.2fx" % r[n]["ratio"] for n in names]
        if r["target"] is None:
            cells += ["-", ""]
        else:
            cells += [f"<= {r['target']}x ({names[-1]})", "met" if r["met"] else "**not met**"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(dev: Device) -> str:
    rates = (f"bf16 {dev.flops[BF16] / 1e12:.3g} TFLOPS, FP32 {dev.flops[FP32] / 1e12:.3g} TFLOPS, "
             f"{dev.bandwidth / 1e12:.3g} TB/s, exp {dev.exps / 1e12:.3g} T/s")
    if math.isfinite(dev.first_touch):
        rates += f", first touch {dev.first_touch / 1e9:.3g} GB/s"
    return (f"{dev.name}: {rates}, {dev.launch_s * 1e6:.0f} us a kernel, chunk budget "
            f"{device_budget(dev) / MIB:.0f} MiB ({dev.source})")


def auto_runs(name: str, in_forward: bool, dev: Device) -> tuple[str, bool]:
    """(plan, gradients in forward) that ``lm_head_plan="auto"`` runs for ``name`` (no mask)
    on ``dev``, a GPU: a log-prob keeps its logits (``tiling.keeps_logits``), a
    cross-entropy alone recomputes them, its loss in the graph on the loss loop where its
    FP32 sums fit under stock's peak (``tiling.holds_weight_sums``)."""
    T, H, V, loss = WORKLOADS[name]
    if tiling.keeps_logits(dev.kind, loss == "logprob"):
        return "kept_logits", in_forward
    return "gpu", in_forward and tiling.holds_weight_sums(T, V, H, dev.kind, loss == "logprob")


def auto_table(devices=DEVICES) -> str:
    """What ``auto`` runs at the H200 run's sizes (W4L-8k, WV-8k), loss in the graph and
    per token, with its ratio to stock on each device and the issue's targets."""
    names = " | ".join(d.name for d in devices)
    lines = ["What `auto` runs on each GPU (no mask), ours / stock:", "",
             f"| workload | loss | plan, path | {names} | target ({devices[-1].name}) |",
             "|" + " --- |" * (4 + len(devices))]
    for name in ("W4L-8k", "WV-8k"):
        T, H, V, loss = WORKLOADS[name]
        for in_forward in (True, False):
            cells = []
            for dev in devices:
                plan, gif = auto_runs(name, in_forward, dev)
                ratio = step_time(ours(T, H, V, plan, gif, device_budget(dev)), dev) / step_time(
                    stock(T, H, V, loss), dev)
                cells.append(f"{ratio:.3f}x")
            bound = TARGETS.get((name, in_forward))
            verdict = "met" if ratio <= bound else "**not met**"  # (on the last device)
            lines.append(f"| {name} | {'in the graph' if in_forward else 'per token'} | {plan}, "
                         f"{_path(H, gif, plan)} | " + " | ".join(cells) + f" | <= {bound}x: {verdict} |")
    return "\n".join(lines)


def report(plans_text: Optional[str] = None) -> str:
    """The H100 / H200 table as Markdown, with its assumptions (what gpu_check prints)."""
    plans, notes = parse_plans(plans_text)
    rows = predict(DEVICES, plans)
    out = ["Predicted (a model, not a measurement: benchmarks/cost_model.py), ratio = ours / stock:", ""]
    out += [table(rows, DEVICES), "", auto_table(), ""] + [f"* {describe(d)}" for d in DEVICES]
    out += [f"* note: {n}" for n in notes]
    return "\n".join(out)


def what_ifs(dev: Device = DEVICES[-1]) -> str:
    """The ``gpu`` plan's loss path as built, and with ``grad_weight`` one GEMM (no FP32
    accumulator traffic) and the backward's scaling free; both paths at a 32 MiB budget
    instead of the device's."""
    lines = [f"What-ifs on the {dev.name}, ours / stock:"]
    for name in ("W4", "WV"):
        T, H, V, loss = WORKLOADS[name]
        base, built = step_time(stock(T, H, V, loss), dev), ours(T, H, V, "gpu", True, device_budget(dev))
        floor = [k for k in built if "backward" not in k.what and "grad_weight" not in k.what]
        small = [step_time(ours(T, H, V, "gpu", gif, 32 * MIB, Build(by_device=False)), dev) / base
                 for gif in (True, False)]
        best = step_time(floor + [gemm("grad_weight", (V, T, H))], dev) / base
        lines.append(f"* {name}: loss in graph as built {step_time(built, dev) / base:.2f}x, grad_weight one "
                     f"GEMM and the scaling free {best:.2f}x; at 32 MiB: loss in graph {small[0]:.2f}x, "
                     f"per-token {small[1]:.2f}x")
    return "\n".join(lines + [floors(dev)] + [kept_logits(name, dev) for name in ("W4L-8k", "WV-8k")]
                     + other_rows(dev))


def other_rows(dev: Device) -> list[str]:
    """The H200 run's other modelled rows at the size it ran them (T 8192, V 151936, H
    4096), as built: ``reduce-overhead`` (WV-8k, ``cost_loops.as_built``: the per-token
    masked op between the captured parts; the loss loop, which a replay would run over
    every row, where its sums fit) and VP (the vocab-parallel one-pass loop on one rank,
    the backward's ``"gpu"`` loops; the run's code ran ``"two_sweeps"``; ``"auto"`` on a GPU
    and ``lm_head_plan="kept_logits"``: the shard's logits kept, NOTE [kept shard logits])."""
    T, H, V, _ = WORKLOADS["WV-8k"]
    budget = device_budget(dev)
    base = step_time(stock(T, H, V, "ce"), dev)
    ks, host = as_built(T, H, V, "gpu", "ce", True, budget, 0.1, replay=True)  # (WV's labels: 10% ignored)
    ro = (step_time(ks, dev) + host) / base
    ro_loop = step_time(masked(T, H, V, "gpu", budget, 0.0), dev) / base
    vp_stock = step_time(stock_vocab_parallel(T, H, V), dev)
    vp = {plan: step_time(vocab_parallel(budget, T, H, V, plan), dev) / vp_stock
          for plan in ("gpu", "two_sweeps", "kept_logits")}
    return [f"* RO (WV-8k, 10% of its labels ignored, under reduce-overhead, as built: the per-token masked "
            f"op between the captured parts, the loss loop's FP32 sums being over stock's peak at T = 2 H): "
            f"{ro:.2f}x; the loss loop replayed over every row: {ro_loop:.2f}x",
            f"* VP-8k (vocab-parallel one-pass loop, one rank): backward 'gpu' (lm_head_plan='gpu') "
            f"{vp['gpu']:.2f}x; 'two_sweeps' (as the 2026-12-04 run ran it) {vp['two_sweeps']:.2f}x; "
            f"'kept_logits' (auto's on a GPU: the logits shard kept, 3 GEMMs) {vp['kept_logits']:.2f}x"]


def floors(dev: Device) -> str:
    """What no loop of ours can go under in this calibration (W4L-8k): stock's own GEMM
    kernels plus the fitted rest of the step (``Device.step_s``), and four of them."""
    T, H, V, loss = WORKLOADS["W4L-8k"]
    ks = stock(T, H, V, loss)
    base, gemms = step_time(ks, dev), sum(kernel_time(k, dev) for k in ks if k.flops)
    return (f"* W4L-8k floors: stock's 3 GEMMs and the rest of the step {(gemms + dev.step_s) / base:.2f}x; "
            f"4 GEMMs {gemms * 4 / 3 / base:.2f}x, with the rest {(gemms * 4 / 3 + dev.step_s) / base:.2f}x")


def kept_logits(name: str, dev: Device) -> str:
    """The per-token plans at ``name``'s size: ``"gpu"`` (the logits recomputed, 4 GEMMs)
    and ``"kept_logits"`` (the forward's bf16 logits, their gradient written in their
    place, 3 GEMMs), time and peak against stock's (``cost_memory``)."""
    from benchmarks import cost_memory as mem  # (imports torch: only for the what-ifs)

    T, H, V, loss = WORKLOADS[name]
    budget, base = device_budget(dev), step_time(stock(T, H, V, loss), dev)
    stock_peak = mem.peak(mem.stock(T, H, V, loss)).bytes
    recompute, kept = (ours(T, H, V, plan, False, budget) for plan in ("gpu", "kept_logits"))
    peaks = [mem.peak(mem.per_token(T, H, V, plan, budget)).bytes / stock_peak
             for plan in ("gpu", "kept_logits")]
    return (f"* {name} per token: gpu {step_time(recompute, dev) / base:.2f}x time, {peaks[0]:.2f}x peak; "
            f"kept_logits {step_time(kept, dev) / base:.2f}x time, {peaks[1]:.2f}x peak")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plans", default=None, help=f"comma list of {', '.join(PLANS)} (default: all)")
    p.add_argument("--what-if", action="store_true", help="the gpu plan's loss path without its overheads")
    p.add_argument("--budgets", nargs="*", type=float, default=None, metavar="MIB",
                   help="ratios at the default chunk budget and these (default 1024 512 256 128 32), H200")
    p.add_argument("--masked", nargs="*", type=float, default=None, metavar="FRACTION",
                   help="ratios by the share of rows the loss leaves out (default 0 0.25 0.5 0.75), H200")
    p.add_argument("--memory", action="store_true", help="predicted peak memory vs stock (cost_memory.py)")
    args = p.parse_args(argv)
    if args.memory:
        from benchmarks.cost_memory import report as memory_report
        print(memory_report())
        return 0
    if args.masked is not None:
        print(masked_table(args.masked or [0.0, 0.25, 0.5, 0.75]))
        return 0
    if args.budgets is not None:
        print(budget_table(args.budgets or None))
        return 0
    print(report(args.plans))
    if args.what_if:
        print("\n" + what_ifs())
    return 0


if __name__ == "__main__":
    sys.exit(main())
