"""Per-rank peak memory and step time of a vocab-parallel step (2 ranks, gloo, CPU).

    .venv/bin/python benchmarks/vocab_parallel.py                    # W3-style: T 2048, V 32768
    .venv/bin/python benchmarks/vocab_parallel.py --rows 4096 --hidden 1024   # W4-style

Each rank holds the hidden states ``[T, H]`` and its lm_head shard ``[V / 2, H]`` (bf16) and
runs examples/vocab_parallel_step.py's GRPO-style loss (``--head``): the Megatron-style
code on the local shard, under stock Inductor, eager, and under ``chunked_logits`` (and
with its ``fuse_lm_head=False``: ``chunked_logits_unfused``; with ``skip_masked_rows=False``:
``chunked_logits_all_rows``); and,
for ``--head ce``, what DTensor users write without us: eager ``F.cross_entropy`` under
``loss_parallel()`` (``loss_parallel_eager``).  Every backend runs in a fresh ``torchrun``
job: one warm-up step (compiles); VmRSS, VmHWM reset, the measured step, VmHWM
(benchmarks/memory.py); then ``--steps`` timed steps (the median, of the slower rank).
The limit per rank is the issue's: what the step must hold when the logits shard never
exists whole, the bf16 gradients of the rank's weight shard and of ``h``, plus one chunk
of the loop (the default budget, 32 MiB), plus the copies of ``h`` and of the weight shard
that the example's step makes (its inputs).  With the lm_head matmul in the compiled
loss (``h @ w_shard.T``, as here) the pass computes the logits per chunk
(:mod:`fx_passes.kernels.log_softmax.shard`).  Times are ratios to stock Inductor from the same run
(the machine is shared and noisy: a rough guide).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.distributed import exit_without_teardown, torchrun_ranks  # noqa: E402
from benchmarks.memory import MIB, hwm, release, reset_peak, rss  # noqa: E402

# stock first: the others print a ratio to it
BACKENDS = ("inductor", "eager", "chunked_logits", "chunked_logits_unfused")


def rank_child(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    from examples import vocab_parallel_step as vp

    p = argparse.ArgumentParser()
    p.add_argument("--backend")
    p.add_argument("--head")
    p.add_argument("--rows", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--ignored", type=float, default=None)
    p.add_argument("--out", type=pathlib.Path)
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    h, w, tok, old_logp, adv = vp.inputs(args, args.head)
    shard = args.vocab // world
    lo = rank * shard
    if args.backend == "loss_parallel_eager":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

        head = torch.nn.Linear(args.hidden, args.vocab, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            head.weight.copy_(w)
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))

        def run():
            hh = h.clone().requires_grad_()
            with loss_parallel():
                F.cross_entropy(head(hh).float() / vp.TEMPERATURE, tok, ignore_index=vp.IGNORE).backward()
            head.weight.grad = None
    else:
        backend, options = args.backend, None
        if backend == "chunked_logits_unfused":  # the pass with the lm_head matmul left whole
            backend, options = "chunked_logits", {"fuse_lm_head": False}
        if backend == "chunked_logits_all_rows":  # the pass running every row, masked or not
            backend, options = "chunked_logits", {"skip_masked_rows": False}

        def run():
            vp.step(args.head, backend, h, w[lo:lo + shard], tok, old_logp, adv, lo, options=options)
    run()
    release()
    dist.barrier()
    before = rss()
    reset_peak()
    run()
    peak = hwm()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    result = {"rank": rank, "peak_mib": (peak - before) / MIB, "seconds": seconds,
              "counters": dict(counters["chunked_logits"])}
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    exit_without_teardown()


BUDGET_MIB = 32  # Config.chunk_budget_mib's default


def limit_mib(rows: int, shard: int, hidden: int) -> float:
    """See the module doc: 2 bytes per gradient and per input copy, plus the budget."""
    return 2 * 2 * (shard * hidden + rows * hidden) / MIB + BUDGET_MIB


def main() -> None:
    if "--rank-child" in sys.argv:
        return rank_child([a for a in sys.argv[1:] if a != "--rank-child"])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", default="logprob", choices=["logprob", "entropy", "ce"])
    p.add_argument("--rows", default="2048")
    p.add_argument("--vocab", default="32768")
    p.add_argument("--hidden", default="64")
    p.add_argument("--steps", default="3", help="timed steps after the measured one (median, slower rank)")
    p.add_argument("--backends", default=None, help="default: inductor,eager,chunked_logits "
                   "(+ loss_parallel_eager for --head ce)")
    p.add_argument("--ignored", default=None,
                   help="--head ce: the fraction of labels -100, the first rows (default: every 7th row)")
    args = p.parse_args()
    backends = args.backends.split(",") if args.backends else [
        *BACKENDS, *(["loss_parallel_eager"] if args.head == "ce" else [])]
    sizes = ["--head", args.head, "--rows", args.rows, "--vocab", args.vocab, "--hidden", args.hidden,
             "--steps", args.steps, *(["--ignored", args.ignored] if args.ignored is not None else [])]
    T, V, H = int(args.rows), int(args.vocab), int(args.hidden)
    limit = limit_mib(T, V // 2, H)
    print(f"2 ranks, gloo, CPU, 1 thread each; head {args.head}; T {T}, V {V} ({V // 2} per rank), H {H}, "
          f"bf16; limit per rank {limit:.1f} MiB (bf16 gradients of the weight shard and of h, one "
          f"{BUDGET_MIB} MiB chunk, the step's copies of h and the weight shard)")
    print(f"{'backend':<22}{'peak r0':>9}{'peak r1':>9}{'x limit':>9}{'time s':>9}{'vs stock':>10}"
          "  counters (rank 0)")
    stock = None
    for backend in backends:
        ranks = torchrun_ranks(__file__, ["--backend", backend, *sizes], backend)
        peak = max(r["peak_mib"] for r in ranks)
        sec = max(r["seconds"] for r in ranks)
        if backend == "inductor":
            stock = sec
        ratio = f"{sec / stock:>9.2f}x" if stock else f"{'':>10}"
        print(f"{backend:<22}{ranks[0]['peak_mib']:>9.1f}{ranks[1]['peak_mib']:>9.1f}{peak / limit:>8.2f}x"
              f"{sec:>9.2f}{ratio}  {ranks[0]['counters']}", flush=True)


if __name__ == "__main__":
    main()
