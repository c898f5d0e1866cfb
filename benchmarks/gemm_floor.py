"""The GEMM floor of a step whose lm_head is in the graph, on this machine: what the GEMMs
alone cost in each order a step can take, before any compiled body runs.

    .venv/bin/python benchmarks/gemm_floor.py --workload WD --threads 1

Three orders of the same bf16 ``[T, H] x [H, V]`` GEMMs (docs/gemms.md):

* ``stock``: logits, ``grad_hidden = g @ W``, ``grad_weight = g.T @ hidden``, each whole
  (stock holds the ``[T, V]`` logits and their gradient: ``4 T V`` bytes);
* ``chunked (4)``: what ``row_local_loss`` runs within the workload's memory limit: the
  forward's row chunks (logits, the weight reordered once for the loop as
  ``kernels/chunk_gemm.py`` does, and ``grad_hidden``), the backward's vocabulary blocks
  (the logits again, ``grad_weight``), at the chunk sizes the kernel picks;
* ``stock, fp32 operands``: stock's three GEMMs on FP32 copies, not an order a step runs:
  what the bf16 GEMMs cost on this CPU next to FP32 ones (on a CPU without bf16 units,
  ATen's bf16 ``g @ W`` is many times slower: docs/measured.md);
* ``fp32 sums (3)``: the three-GEMM order a CPU could run, ``grad_weight`` summed over
  the row chunks in an FP32 ``[V, H]`` buffer.  The only GEMM in torch on a CPU with bf16
  inputs and an FP32 result is oneDNN's FP32 GEMM under
  ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"`` (inputs rounded to bf16, exact
  here: they are bf16 values; FP32 sums, checked below), so each chunk is upcast first.

Each round times every family once, the orders interleaved (this machine's speed moves
by tens of percent between minutes); the table gives each order's median and fastest
round and its ratio to stock's.  Read it next to ``run.py``'s step ratio: a chunked step
cannot be faster than stock's by more than the bodies it saves.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.cases import LM_HEAD_HIDDEN, LM_HEAD_WORKLOADS, limit_bytes, sizes  # noqa: E402
from fx_passes.config import Config  # noqa: E402
from fx_passes.kernels.chunk_gemm import row_chunk_logits  # noqa: E402
from fx_passes.kernels.tiling import sweep_step  # noqa: E402

MIB = 2 ** 20


def families(T: int, H: int, V: int, budget: int, rows: int = 0, cols: int = 0) -> dict[str, dict]:
    """name -> {order: GEMM thunk}; each thunk runs one family over the whole step."""
    bf = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=gen).to(bf)
    w = (torch.randn(V, H, generator=gen) / H ** 0.5).to(bf)
    g = (torch.randn(T, V, generator=gen) * 1e-3).to(bf)  # (stands for the logits' gradient)
    grad_h, grad_w = torch.empty(T, H, dtype=bf), torch.empty(V, H, dtype=bf)
    acc = torch.zeros(V, H)
    rows, cols = rows or sweep_step(T, V, budget, h.device), cols or sweep_step(V, T, budget, h.device)
    row_chunks = [(a, min(a + rows, T)) for a in range(0, T, rows)]
    blocks = [(a, min(a + cols, V)) for a in range(0, V, cols)]

    def fp32_sums():
        old = torch.backends.mkldnn.matmul.fp32_precision
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        try:
            for a, b in row_chunks:
                acc.addmm_(g[a:b].float().t(), h[a:b].float())
        finally:
            torch.backends.mkldnn.matmul.fp32_precision = old

    h32, w32, g32 = h.float(), w.float(), g.float()
    reordered = row_chunk_logits(w, None, "matmul", row_chunks)  # (as the kernel: once a loop)
    chunk_logits = lambda: [reordered(h[a:b]) for a, b in row_chunks]  # noqa: E731
    chunk_grad_h = lambda: [torch.mm(g[a:b], w, out=grad_h[a:b]) for a, b in row_chunks]  # noqa: E731
    out = {
        "stock": {"logits": lambda: h @ w.t(), "grad_hidden": lambda: g @ w,
                  "grad_weight": lambda: g.t() @ h},
        "chunked (4)": {
            "logits": chunk_logits, "grad_hidden": chunk_grad_h,
            "logits again": lambda: [h @ w[a:b].t() for a, b in blocks],
            "grad_weight": lambda: [torch.mm(g[:, a:b].t(), h, out=grad_w[a:b]) for a, b in blocks]},
        "fp32 sums (3)": {"logits": chunk_logits, "grad_hidden": chunk_grad_h, "grad_weight": fp32_sums},
        # (stock's three GEMMs on FP32 copies: what the bf16 GEMMs cost on this CPU; not an
        # order any step runs.  Without bf16 units (AVX2 only) ATen's bf16 ``g @ W`` takes a
        # slow path: docs/measured.md)
        "stock, fp32 operands": {"logits": lambda: h32 @ w32.t(), "grad_hidden": lambda: g32 @ w32,
                                 "grad_weight": lambda: g32.t() @ h32},
        # (the forward's logits as they ran before kernels/chunk_gemm.py: the weight reordered
        # by oneDNN at every chunk's GEMM; not an order of its own)
        "logits, weight reordered every chunk": {"logits": lambda: [h[a:b] @ w.t() for a, b in row_chunks]},
    }
    return {"families": out, "rows": rows, "cols": cols, "check": (g, h, acc)}


def fp32_sums_error(g: torch.Tensor, h: torch.Tensor) -> float:
    """Relative max error of one chunk's ``g.T @ h`` under the bf16 mode against FP64:
    about 1e-7 when oneDNN sums in FP32 (a bf16 result would be about 4e-3)."""
    a, b = g[:64].float(), h[:64].float()
    old = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        got = a.t() @ b
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = old
    want = a.double().t() @ b.double()
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="WD", choices=LM_HEAD_WORKLOADS)
    p.add_argument("--scale", type=int, default=1, help="divide T and V by this")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rows", type=int, default=0, help="rows a forward chunk (0: the kernel's choice)")
    p.add_argument("--cols", type=int, default=0, help="columns a backward block (0: the kernel's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    T, V = sizes(args.workload, args.scale)
    H = LM_HEAD_HIDDEN
    made = families(T, H, V, Config().device_budget_bytes, args.rows, args.cols)
    orders = made["families"]
    times: dict[str, dict[str, list[float]]] = {o: {f: [] for f in fs} for o, fs in orders.items()}
    for _ in range(args.rounds + 1):  # (the first round warms up, not counted)
        for order, fams in orders.items():
            for name, run in fams.items():
                t0 = time.perf_counter()
                run()
                times[order][name].append(time.perf_counter() - t0)
    totals = {o: [sum(r) for r in zip(*fs.values())][1:] for o, fs in times.items()}
    base_med, base_min = statistics.median(totals["stock"]), min(totals["stock"])
    print(f"{args.workload} T {T}, H {H}, V {V}, {torch.get_num_threads()} thread(s), {args.rounds} rounds; "
          f"chunks: {made['rows']} rows forward, {made['cols']} columns backward")
    print("\n| order | GEMM families (median s) | total median s | total fastest s "
          "| vs stock (median; fastest) |")
    print("| --- | --- | --- | --- | --- |")
    for order, fams in times.items():
        if order.startswith("logits, "):
            med = statistics.median(totals[order])
            once = statistics.median(times["chunked (4)"]["logits"][1:])
            print(f"\nthe forward's logits with the weight reordered every chunk (before chunk_gemm.py): "
                  f"{med:.3f} s median, against {once:.3f} s reordered once")
            continue
        parts = ", ".join(f"{n} {statistics.median(t[1:]):.3f}" for n, t in fams.items())
        med, fast = statistics.median(totals[order]), min(totals[order])
        print(f"| {order} | {parts} | {med:.3f} | {fast:.3f} "
              f"| {med / base_med:.2f}x; {fast / base_min:.2f}x |")
    g, h, _ = made["check"]
    limit = limit_bytes(args.workload, T, V)
    held = 4 * V * H + 2 * V * H + 2 * T * H
    print(f"\nfp32 sums: one chunk's relative error against FP64 {fp32_sums_error(g, h):.1e} (FP32 sums); "
          f"its [V, H] FP32 buffer with the bf16 grad_weight and grad_hidden it rounds into: "
          f"{held / MIB:.0f} MiB before any chunk, against {args.workload}'s limit {limit / MIB:.0f} MiB "
          f"(x1.15: {1.15 * limit / MIB:.0f} MiB)")


if __name__ == "__main__":
    main()
