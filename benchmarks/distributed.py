"""Per-rank peak memory of one DDP / FSDP2 training step, stock Inductor vs chunked_logits.

    .venv/bin/python benchmarks/distributed.py                  # DDP and FSDP2, 2 ranks, gloo
    .venv/bin/python benchmarks/distributed.py --setups ddp --vocab 32768 --seq 1024

Every (setup, backend) runs in a fresh ``torchrun --standalone`` job; each rank
compiles and warms up the step (examples/distributed_step.py's model and wrapping),
then measures the step itself as benchmarks/memory.py does: VmRSS before, VmHWM
reset with clear_refs, VmHWM after.  The sizes are chosen so the logits dominate.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.memory import MALLOC_ENV, MIB, hwm, release, reset_peak, rss  # noqa: E402
from fx_passes.env import without_ours  # noqa: E402

BACKENDS = ("inductor", "chunked_logits")


def rank_child(argv: list[str]) -> None:
    """One rank: warm-up step (compiles), then the measured step; writes rank<r>.json."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from examples import distributed_step as ds

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
    result = {"rank": rank, "peak_mib": (peak - before) / MIB, "counters": dict(counters["chunked_logits"])}
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # neither rank tears gloo down while the other still measures
    dist.destroy_process_group()


def run_case(setup: str, backend: str, sizes: list[str]) -> list[dict]:
    exe = shutil.which("torchrun", path=str(pathlib.Path(sys.executable).parent))
    with tempfile.TemporaryDirectory() as out:
        cmd = [exe, "--standalone", "--nproc-per-node", "2", __file__, "--rank-child", "--setup", setup,
               "--backend", backend, "--out", out, *sizes]
        env = without_ours(OMP_NUM_THREADS="1", **MALLOC_ENV)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        if proc.returncode:
            raise SystemExit(f"{setup}/{backend} failed:\n{proc.stderr[-3000:]}")
        return [json.loads((pathlib.Path(out) / f"rank{r}.json").read_text()) for r in (0, 1)]


def main() -> None:
    if "--rank-child" in sys.argv:
        return rank_child([a for a in sys.argv[1:] if a != "--rank-child"])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", default="ddp,fsdp2")
    p.add_argument("--vocab", default="32768")
    p.add_argument("--hidden", default="64")
    p.add_argument("--batch", default="1")
    p.add_argument("--seq", default="1024")
    args = p.parse_args()
    sizes = ["--vocab", args.vocab, "--hidden", args.hidden, "--batch", args.batch, "--seq", args.seq]
    print(f"2 ranks, gloo, CPU; batch {args.batch} x seq {args.seq} per rank, V={args.vocab}, "
          f"H={args.hidden}, bf16; peak extra MiB of one step per rank")
    print(f"{'setup':<7}{'backend':<16}{'rank 0':>9}{'rank 1':>9}{'vs stock':>10}  counters (rank 0)")
    for setup in args.setups.split(","):
        stock = None
        for backend in BACKENDS:
            ranks = run_case(setup, backend, sizes)
            peaks = [r["peak_mib"] for r in ranks]
            stock = stock or max(peaks)
            print(f"{setup:<7}{backend:<16}{peaks[0]:>9.1f}{peaks[1]:>9.1f}{max(peaks) / stock:>9.2f}x  "
                  f"{ranks[0]['counters']}", flush=True)


if __name__ == "__main__":
    main()
