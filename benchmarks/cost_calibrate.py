"""The cost model (``benchmarks/cost_model.py``) on this CPU, and its GEMM audit.

``calibrate``: this CPU's GEMM rates (``torch.mm`` at W4's shape, bf16 and FP32), copy
bandwidth and ``exp`` rate, measured on one thread (as ``run.py --threads 1`` times),
take the GPU's place in the model; its predicted ours / stock ratios for W3 and W4 are
set beside the ratios ``run.py`` measured.  ``audit``: W4 and WV compiled at small size
with each plan forced, every GEMM of a step recorded (``fx_passes.testing.gemms``), and
compared with the GEMMs the model lists for that size.
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import statistics
import sys
import time
import types

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import cost_loops as loops  # noqa: E402
from benchmarks import cost_model as cm  # noqa: E402
from benchmarks import cost_roofline as roof  # noqa: E402

CALIBRATION_BOUND = 0.25  # issue 22: predicted within 25% of measured


def _median(fn, reps: int) -> float:
    """Seconds per call, the median of ``reps`` after a warm-up: run.py compares medians
    too, so on a shared machine both see the same share of a core."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(threads: int = 1) -> roof.Device:
    """This CPU as a ``cost_roofline.Device`` (no chunk budget of its own: ``tiling``'s CPU one)."""
    torch.set_num_threads(threads)
    T, H, V = 4096, cm.H_LM, 32768
    flops = {}
    for name, dtype, n in ((roof.BF16, torch.bfloat16, V), (roof.FP32, torch.float32, V // 4)):
        a, b = torch.randn(T, H).to(dtype), torch.randn(H, n).to(dtype)
        c = torch.empty(T, n, dtype=dtype)
        flops[name] = 2.0 * T * H * n / _median(lambda: torch.mm(a, b, out=c), 3)
    src = torch.ones(64 * roof.MIB)  # 256 MiB
    dst = torch.empty_like(src)
    copy = _median(lambda: dst.copy_(src), 5)
    # first touch: filling a buffer allocated just before (its pages fault in) minus a warm fill
    first_touch = src.numel() * 4 / max(1e-9, _median(lambda: torch.empty_like(src).fill_(2.0), 3)
                                        - _median(lambda: dst.fill_(2.0), 3))
    # a fused exp pass as Inductor generates it (read bf16, upcast, exp, row sum): exps per second
    x = torch.randn(2048, 32768).to(torch.bfloat16)
    exp_pass = torch.compile(lambda x: x.float().exp().sum(-1), backend="inductor")
    exps = x.numel() / _median(lambda: exp_pass(x), 5)
    bandwidth = 2.0 * 4 * src.numel() / copy
    return roof.Device(f"this CPU ({threads} thread)", flops, bandwidth, exps, 10e-6, 0, "cpu",
                     f"measured: torch.mm [{T}, {H}] x [{H}, {V}] bf16 and [{T}, {H}] x [{H}, {V // 4}] "
                     "FP32, a 256 MiB copy (read + write), an Inductor-compiled exp-and-sum pass over bf16 "
                     "[2048, 32768], a fresh 256 MiB fill minus a warm one; medians of 3-5",
                     first_touch)


def measured_ratios(spec: str) -> dict[str, tuple[float, int]]:
    """{workload: (ours / stock, timed T)} from ``run.py``'s CSV, or ``"W3=0.58,W4=1.34"``."""
    if "=" in spec:
        return {k.strip(): (float(v), cm.WORKLOADS[k.strip()][0])
                for k, v in (item.split("=") for item in spec.split(","))}
    out = {}
    with open(spec, newline="") as f:
        for row in csv.DictReader(f):
            if row["mode"] == "chunked_logits" and row.get("t_ratio_vs_stock"):
                out[row["workload"]] = (float(row["t_ratio_vs_stock"]), int(row["time_T"]))
    return out


def _split(kernels: list[roof.Kernel], dev: roof.Device) -> str:
    g = sum(roof.kernel_time(k, dev) for k in kernels if k.flops)
    rest = sum(roof.kernel_time(k, dev) for k in kernels if not k.flops)
    return f"{1e3 * (g + rest):.0f} ms (GEMMs {1e3 * g:.0f}, other {1e3 * rest:.0f})"


def calibrate(spec: str, plan: str, in_forward: bool) -> str:
    dev = measure()
    measured = measured_ratios(spec) if spec else {}
    lines = [cm.describe(dev), "",
             "| workload | plan | measured ours / stock | predicted | predicted / measured | within 25% |",
             "| --- | --- | --- | --- | --- | --- |"]
    detail = []
    for name in ("W3", "W4"):
        T, H, V, loss = cm.WORKLOADS[name]
        ratio, T = measured.get(name, (None, T))
        base = loops.stock(T, H, V, loss)
        ks = loops.ours(T, H, V, plan, in_forward, roof.device_budget(dev), loops.Build(dev.kind))
        pred = roof.step_time(ks, dev) / roof.step_time(base, dev)
        shown = plan + (" (grads in forward)" if in_forward else "") if H else "-"
        if ratio is None:
            lines.append(f"| {name} | {shown} | (not measured) | {pred:.2f}x | - | - |")
        else:
            ok = abs(pred / ratio - 1) <= CALIBRATION_BOUND
            lines.append(f"| {name} | {shown} | {ratio:.2f}x | {pred:.2f}x | {pred / ratio:.2f} | "
                         f"{'yes' if ok else '**no**'} |")
        detail.append(f"* {name} at T {T}: stock {_split(base, dev)}; ours {_split(ks, dev)}")
    return "\n".join(lines + [""] + detail)


# --- the audit ----------------------------------------------------------------------------

AUDIT_SIZES = {"W4": (512, 4096), "WV": (512, 4748)}
AUDIT_BUDGET_MIB = 32  # the CPU's default, given explicitly (the GPU's is the model's own)


def _recorded(name: str, T: int, V: int, options: dict) -> list:
    from fx_passes.testing.gemms import cpu_out_dtype_kernels, recording
    from fx_passes.testing.workloads import ALL_WORKLOADS, ensure_backend, run_step

    ensure_backend()
    w = ALL_WORKLOADS[name]
    inputs = w.make(T, V)
    fn = torch.compile(_fresh(w.fn), backend="chunked_logits", options=options)
    with cpu_out_dtype_kernels():
        run_step(w, fn, inputs)  # compiles
        with recording() as gemms:
            run_step(w, fn, inputs)
    return list(gemms)


def _fresh(fn):
    """A copy of ``fn`` with its own code object: its own Dynamo cache per plan."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)


def audit(plans: list[str], echo=print) -> str:
    """Recorded vs modelled GEMMs (count, full-GEMM equivalents by input dtype) per plan,
    each line given to ``echo`` as it comes (compiling takes minutes)."""
    lines = ["| workload | plan | grads in forward | recorded GEMMs: n, bf16 / fp32 | modelled | same |",
             "| --- | --- | --- | --- | --- | --- |"]
    for line in lines:
        echo(line)
    budget = AUDIT_BUDGET_MIB * roof.MIB
    for name, (T, V) in AUDIT_SIZES.items():
        H = cm.WORKLOADS[name][1]
        for plan in plans:
            for gif in ((True, False) if plan in loops.GIF else (False,)):
                try:
                    got = _recorded(name, T, V, {"lm_head_plan": plan, "gradients_in_forward": gif,
                                                 "chunk_budget_mib": AUDIT_BUDGET_MIB})
                except Exception as e:  # a plan this checkout cannot run: say so, go on
                    why = f"{type(e).__name__}: {str(e)[:80]}"
                    lines.append(f"| {name} | {plan} | {gif} | error: {why} | | |")
                    echo(lines[-1])
                    continue
                rec = (len(got), sum(g.flops for g in got if g.in_dtype == torch.bfloat16) / (2 * T * H * V),
                       sum(g.flops for g in got if g.in_dtype == torch.float32) / (2 * T * H * V))
                ks = [k for k in loops.ours(T, H, V, plan, gif, budget, loops.Build("cpu")) if k.flops]
                mod = (sum(k.n for k in ks), roof.full_gemms(ks, T, H, V, roof.BF16),
                       roof.full_gemms(ks, T, H, V, roof.FP32))
                same = rec[0] == mod[0] and abs(rec[1] - mod[1]) < 1e-6 and abs(rec[2] - mod[2]) < 1e-6
                lines.append(f"| {name} | {plan} | {gif} | {rec[0]}, {rec[1]:.2f} / {rec[2]:.2f} | "
                             f"{mod[0]}, {mod[1]:.2f} / {mod[2]:.2f} | {'yes' if same else '**no**'} |")
                echo(lines[-1])
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibrate", action="store_true", help="measure this CPU; predicted vs measured W3, W4")
    p.add_argument("--measured", default="bench_out/results.csv",
                   help="run.py's CSV with W3 and W4 timed (or 'W3=0.58,W4=1.34')")
    p.add_argument("--plan-ran", default="two_sweeps", help="the lm_head plan the measured W4 ran")
    p.add_argument("--gif-ran", action="store_true", help="the measured W4 took the grads-in-forward path")
    p.add_argument("--audit", action="store_true", help="recorded vs modelled GEMMs, W4 and WV at small size")
    p.add_argument("--plans", default=None, help=f"comma list of {', '.join(cm.PLANS)} (default: all)")
    args = p.parse_args(argv)
    if args.audit:
        audit(cm.parse_plans(args.plans)[0], echo=lambda line: print(line, flush=True))
    if args.calibrate or not args.audit:
        print(calibrate(args.measured, args.plan_ran, args.gif_ran))
    return 0


if __name__ == "__main__":
    sys.exit(main())
