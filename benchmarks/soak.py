"""Soak test: 200 training steps of W3 with varying T under chunked_logits, dynamic=True.

    .venv/bin/python benchmarks/soak.py             # full size: V=32768, T cycling 2048..1280
    .venv/bin/python benchmarks/soak.py --scale 8   # quick

Step 0 compiles (warm-up, outside the windows).  Window A is steps 1-20, window B
steps 21-200; the high-water mark VmHWM is reset (/proc/self/clear_refs) at the
start of each window and read at its end.  Pass: peak(B) / peak(A) <= 1.05, i.e.
memory does not grow with the number of steps or of distinct lengths seen.  The
compile count shows that a new length does not recompile.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.cases import make_case, make_inputs, sizes  # noqa: E402
from benchmarks.memory import MIB, hwm, release, reset_peak, rss  # noqa: E402

PASS_RATIO = 1.05


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=int, default=1, help="divide T and V by this")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--window", type=int, default=20, help="steps in the first window")
    return p.parse_args(argv)


def lengths(T: int) -> list[int]:
    """The T values cycled over: T, 7/8 T, 3/4 T, 5/8 T (distinct, all > 2)."""
    return sorted({max(T * k // 8, 3) for k in (8, 7, 6, 5)}, reverse=True)


def run_window(case, inputs_by_t: dict, steps: range, ts: list[int]) -> tuple[float, float, float]:
    """Run ``steps``; returns (RSS at the start, peak RSS, RSS at the end) in MiB."""
    release()
    start = rss() / MIB
    reset_peak()
    for i in steps:
        case.inputs = inputs_by_t[ts[i % len(ts)]]
        out = case.step()
        del out
        case.clear_grads()
        if i % 25 == 0:
            print(f"  step {i:4d}  T={ts[i % len(ts)]:5d}  RSS {rss() / MIB:8.1f} MiB", flush=True)
    return start, hwm() / MIB, rss() / MIB


def summarize(args, windows: dict, graphs: int, ts: list[int]) -> bool:
    """Print both windows, the ratio and the compile count; True when both checks pass."""
    for (first, last), (start, peak, end) in windows.items():
        print(f"peak RSS steps {first}-{last}: {peak:.1f} MiB (RSS {start:.1f} MiB at the start, "
              f"{end:.1f} MiB at step {last}; peak {peak - start:.1f} MiB above the start)")
    (_, peak_a, _), (_, peak_b, _) = windows.values()
    ratio = peak_b / peak_a
    ratio_ok, graphs_ok = ratio <= PASS_RATIO, graphs == 1
    print(f"ratio peak(step {args.steps}) / peak(step {args.window}): {ratio:.4f}  "
          f"-> {'PASS' if ratio_ok else 'FAIL'} (<= {PASS_RATIO})")
    print(f"compiled graphs: {graphs} for {len(ts)} lengths  -> {'PASS' if graphs_ok else 'FAIL'} (== 1)")
    return ratio_ok and graphs_ok


def main(argv=None) -> int:
    from torch._dynamo.utils import counters
    args = parse_args(argv)
    T, V = sizes("W3", args.scale)
    ts = lengths(T)
    print(f"soak: W3 chunked_logits dynamic=True, V={V}, T cycling over {ts}, {args.steps} steps")
    inputs_by_t = {t: make_inputs("W3", t, V, seed=t) for t in ts}
    case = make_case("W3", "chunked_logits_dyn", ts[0], V, inputs_by_t[ts[0]])
    t0 = time.time()
    case.step()  # step 0: compile
    case.clear_grads()
    print(f"  step 0 (compile) {time.time() - t0:.1f} s")
    t0 = time.time()
    windows = {(first, last): run_window(case, inputs_by_t, range(first, last + 1), ts)
               for first, last in ((1, args.window), (args.window + 1, args.steps))}
    print(f"{(time.time() - t0) / args.steps * 1e3:.0f} ms/step; "
          f'counters["chunked_logits"]={dict(counters["chunked_logits"])}')
    ok = summarize(args, windows, counters["stats"].get("unique_graphs", 0), ts)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
