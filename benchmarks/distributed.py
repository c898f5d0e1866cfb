"""Per-rank peak memory of one DDP / FSDP2 training step, stock Inductor vs chunked_logits.

    .venv/bin/python benchmarks/distributed.py                  # DDP and FSDP2, 2 ranks, gloo
    .venv/bin/python benchmarks/distributed.py --setups fsdp2 --lm-head-in loss

Every (setup, backend) runs in a fresh ``torchrun --standalone`` job; each rank
compiles and warms up the step (examples/distributed_step.py's model and wrapping),
then measures the step itself as benchmarks/memory.py does: VmRSS before, VmHWM
reset with clear_refs, VmHWM after; then times ``--steps`` more steps.  The sizes are
chosen so the logits dominate.  The limit per rank is the rank's bf16 gradients plus
one FP32 chunk of the pass's loop (``limit_bytes``).  Times are separate jobs, not
interleaved: on a shared machine read the ratio as a rough one.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.memory import MALLOC_ENV, MIB, hwm, release, reset_peak, rss  # noqa: E402
from fx_passes.env import without_ours  # noqa: E402

BACKENDS = ("inductor", "chunked_logits")


def limit_bytes(model, rows: int, hidden: int, vocab: int) -> int:
    """The per-rank limit: the bf16 gradients of the parameters this rank holds (all
    of them under DDP, its shard under FSDP2), the bf16 gradient of the last hidden
    state, and one FP32 chunk of the pass's forward loop."""
    from fx_passes.config import Config
    from fx_passes.kernels.tiling import forward_rows

    grads = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 2 for p in model.parameters())
    chunk = forward_rows(Config().chunk_budget_bytes, rows, vocab) * vocab * 4
    return grads + rows * hidden * 2 + chunk


def rank_child(argv: list[str]) -> None:
    """One rank: warm-up step (compiles), the measured step, then ``--steps`` timed
    steps; writes rank<r>.json."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from examples import distributed_step as ds

    own = argparse.ArgumentParser()
    own.add_argument("--steps", type=int, default=3)
    steps, argv = own.parse_known_args(argv)
    args = ds.parse_args(argv)
    (args.head,) = args.head  # one head per measured job
    dist.init_process_group("gloo")
    rank, args.world = dist.get_rank(), dist.get_world_size()
    model, compiled = ds.compiled_model(args, args.backend)
    ids, tok = ds.batch(args, rank)
    compiled(ids, tok).backward()
    model.zero_grad(set_to_none=True)
    release()
    before = rss()
    reset_peak()
    loss = compiled(ids, tok)
    loss.backward()
    peak = hwm()
    times = []
    for _ in range(steps.steps):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        compiled(ids, tok).backward()
        times.append(time.perf_counter() - start)
    result = {"rank": rank, "peak_mib": (peak - before) / MIB, "counters": dict(counters["chunked_logits"]),
              "limit_mib": limit_bytes(model, ids.numel(), args.hidden, args.vocab) / MIB,
              "step_s": statistics.median(times)}
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # neither rank tears gloo down while the other still measures
    exit_without_teardown()


def exit_without_teardown() -> None:
    """End a rank now that its results are written.  Seen once per few runs of the DDP
    jobs: a rank hung for good in its exit, in ``~ProcessGroupGloo`` joining a gloo thread
    (from the DDP reducer's deallocation, after ``destroy_process_group``; the other rank
    had exited).  Nothing is left to tear down that matters to a benchmark."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def torchrun_ranks(script: str, argv: list[str], label: str, timeout: float = 600,
                   ranks: int = 2) -> list[dict]:
    """``script --rank-child *argv --out DIR`` on ``ranks`` ranks (a fresh ``torchrun``
    job, 1 thread each, benchmarks/memory.py's malloc settings): what each rank wrote."""
    exe = shutil.which("torchrun", path=str(pathlib.Path(sys.executable).parent))
    with tempfile.TemporaryDirectory() as out:
        cmd = [exe, "--standalone", "--nproc-per-node", str(ranks), script, "--rank-child", *argv,
               "--out", out]
        env = without_ours(OMP_NUM_THREADS="1", **MALLOC_ENV)
        # A session of its own, so a hung job goes down with both ranks.
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=env, start_new_session=True) as proc:
            try:
                _, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                _kill_ranks(out)  # (ranks outlive torchrun's process group when hung in exit)
                _, err = proc.communicate()
                raise SystemExit(f"{label} did not finish in {timeout:.0f} s:\n{err[-3000:]}")
        if proc.returncode:
            raise SystemExit(f"{label} failed:\n{err[-3000:]}")
        return [json.loads((pathlib.Path(out) / f"rank{r}.json").read_text()) for r in range(ranks)]


def _kill_ranks(marker: str) -> None:
    """SIGKILL every process whose command line holds ``marker`` (the job's out folder)."""
    for proc in pathlib.Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            continue


def run_case(setup: str, backend: str, sizes: list[str], timeout: float = 600) -> list[dict]:
    return torchrun_ranks(__file__, ["--setup", setup, "--backend", backend, *sizes], f"{setup}/{backend}",
                          timeout)


def main() -> None:
    if "--rank-child" in sys.argv:
        return rank_child([a for a in sys.argv[1:] if a != "--rank-child"])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", default="ddp,fsdp2")
    p.add_argument("--vocab", default="8192")
    p.add_argument("--hidden", default="64")
    p.add_argument("--batch", default="1")
    p.add_argument("--seq", default="1024")
    p.add_argument("--lm-head-in", default="model", choices=["model", "loss"],
                   help="fsdp2: where the step applies the lm_head (examples/distributed_step.py)")
    p.add_argument("--steps", default="3", help="timed steps per rank after the measured one (median)")
    args = p.parse_args()
    sizes = ["--vocab", args.vocab, "--hidden", args.hidden, "--batch", args.batch, "--seq", args.seq,
             "--lm-head-in", args.lm_head_in, "--steps", args.steps]
    print(f"2 ranks, gloo, CPU; batch {args.batch} x seq {args.seq} per rank, V={args.vocab}, "
          f"H={args.hidden}, bf16, fsdp2 lm_head in {args.lm_head_in}; peak extra MiB of one step per rank; "
          f"limit: the rank's bf16 grads + one FP32 chunk; time: median of {args.steps} steps, slower rank")
    print(f"{'setup':<7}{'backend':<16}{'rank 0':>9}{'rank 1':>9}{'limit':>8}{'peak/limit':>12}"
          f"{'vs stock':>10}{'time vs stock':>15}  counters (rank 0)")
    for setup in args.setups.split(","):
        stock = None
        for backend in BACKENDS:
            ranks = run_case(setup, backend, sizes)
            peaks = [r["peak_mib"] for r in ranks]
            limit, step_s = max(r["limit_mib"] for r in ranks), max(r["step_s"] for r in ranks)
            stock = stock or (max(peaks), step_s)
            print(f"{setup:<7}{backend:<16}{peaks[0]:>9.1f}{peaks[1]:>9.1f}{limit:>8.1f}"
                  f"{max(peaks) / limit:>11.2f}x{max(peaks) / stock[0]:>9.2f}x{step_s / stock[1]:>14.2f}x  "
                  f"{ranks[0]['counters']}", flush=True)


if __name__ == "__main__":
    main()
