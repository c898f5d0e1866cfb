"""Where one step's time goes: each mode's step of a workload under the profiler (after
warm-up, the modes in one process, one after the other), the GEMMs' share and the top
ops by their own CPU time.

    .venv/bin/python benchmarks/profile_step.py --workload WD --modes inductor,chunked_logits --threads 1
    .venv/bin/python benchmarks/profile_step.py --workload W4M --rows 2048 --mask-style padding --shapes \
        --modes inductor,chunked_logits,chunked_logits_all_rows --threads 1   # the GEMMs of the kept rows

Read it next to ``run.py``'s ratios: ``run.py`` times steps interleaved across modes
(the ratio to trust on a noisy machine); this says what a step is made of (GEMMs, the
compiled bodies, the rest).  With one thread the self times add up to the step.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.cases import MODES, make_case, make_inputs, sizes  # noqa: E402
from fx_passes.testing.workloads import ALL_WORKLOADS, set_mask  # noqa: E402

GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
         "mkldnn::_linear_pointwise")  # (the last: a chunk GEMM on a reordered weight, kernels/chunk_gemm.py)


def profile_mode(case, warmup: int, rows: int, shapes: bool = False) -> str:
    """``shapes``: one line per op and input shapes (a GEMM's rows: the rows it ran)."""
    from torch.profiler import profile

    for _ in range(warmup):
        case.step()
        case.clear_grads()
    with profile(record_shapes=shapes) as prof:
        case.step()
    case.clear_grads()
    events = prof.key_averages(group_by_input_shape=shapes)
    total = sum(e.self_cpu_time_total for e in events) / 1e3
    gemm = [e for e in events if e.key in GEMMS]
    gemm_ms = sum(e.self_cpu_time_total for e in gemm) / 1e3
    calls = sum(e.count for e in gemm)
    head = (f"{case.name} {case.mode}: step {total:.0f} ms (self CPU time, profiled), GEMMs {gemm_ms:.0f} ms "
            f"in {calls} calls, the rest {total - gemm_ms:.0f} ms")
    return head + "\n" + events.table(sort_by="self_cpu_time_total", row_limit=rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="WD", choices=sorted(ALL_WORKLOADS))
    p.add_argument("--modes", default="inductor,chunked_logits")
    p.add_argument("--scale", type=int, default=1, help="divide T and V by this")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ops", type=int, default=12, help="ops listed per mode")
    p.add_argument("--rows", type=int, default=None, help="T instead of the workload's (before --scale)")
    p.add_argument("--mask", type=float, default=0.5, help="as run.py's (W4C, W4M, ...)")
    p.add_argument("--mask-style", default="prompt", choices=("prompt", "padding"), help="as run.py's")
    p.add_argument("--shapes", action="store_true", help="one line per op and input shapes")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    set_mask(args.mask, args.mask_style)
    T, V = sizes(args.workload, args.scale, args.rows)
    inputs = make_inputs(args.workload, T, V)
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        print(profile_mode(make_case(args.workload, mode, T, V, inputs), args.warmup, args.ops, args.shapes))


if __name__ == "__main__":
    main()
