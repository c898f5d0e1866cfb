"""Predicted peak memory of one step, stock Inductor's and chunked_logits' per plan (the
cost model's memory term; ``benchmarks/cost_model.py`` predicts the time).

    .venv/bin/python benchmarks/cost_model.py --memory     # T 8192, V 151936, H 4096: H100 / H200
    .venv/bin/python benchmarks/cost_measured.py --memory  # vs the recorded H200 run's peak_mib

The peak is what ``benchmarks/gpu_case.py`` measures (``peak_bytes``): the most a step
holds at once above what was allocated before it.  The inputs and the weights are
allocated before; what the step allocates counts, the input gradients it leaves behind
included.  A step is a list of phases (:class:`Phase`), each the buffers alive together at
its worst moment, every one named and sized from what the code allocates; the peak is the
largest phase.  Model precision is bf16 (2 bytes), sums are FP32 (4); a few per-row
vectors (``[T]``) are left out (kilobytes).  Chunk sizes come from ``fx_passes.kernels.tiling``
at the budget given (the device's: ``cost_roofline.device_budget``).

* stock: the bf16 logits, saved for the backward, whose gradient Inductor writes in their
  place; the log-probs' gather adds an FP32 ``[T, V]`` gradient, zero-filled, read by the
  backward's row kernel; then ``grad_hidden`` and ``grad_weight`` from their GEMMs.
* ours, the loss in the graph (``log_softmax/loss.py``; ``row_local/loss.py``): the FP32
  ``[V, H]`` and ``[T, H]`` sums from the forward to the backward, a chunk's logits (the
  lm_head loss writes their gradient in their place; the row-local loss beside them),
  then the backward's bf16 gradients rounded from the sums (``grad_hidden`` first, its sum
  then freed).  ``as_run``: the code the 2026-12-04 run measured, whose
  loss loops, row-local loop and ``"blocks"`` plan held a tile more and whose ``"gpu"``
  per-token blocks were one more (the recorded rows validate it).
* ours, per token (``lm_head.py``'s forward, the backward plans of ``lm_head_sweeps.py`` /
  ``gpu_plan.py``): the bf16 gradients, the plan's FP32 ``grad_hidden`` sum and its tiles.
* a mask (rows the loss leaves out): the kept rows' hidden states gathered, the loop on them.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
from typing import Optional

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cost_loops import gpu_block_cols_2026_12_04  # noqa: E402
from benchmarks.cost_roofline import DEVICES, MIB, device_budget  # noqa: E402
from fx_passes.kernels import tiling  # noqa: E402

BF, F4 = 2, 4  # bytes of model precision (bf16) and of an FP32 sum
SHAPE = (8192, 151936, 4096)  # (T, V, H) of the GPU run and of the targets
TARGETS = {"WV": 0.6, "WD": 1.0}  # peak vs stock at SHAPE (the loss in the graph)


@dataclasses.dataclass(frozen=True)
class Phase:
    """The buffers a step holds together at one moment: ``(what, bytes)`` each."""

    name: str
    terms: tuple

    @property
    def bytes(self) -> float:
        return float(sum(b for _, b in self.terms))


def peak(phases: list[Phase]) -> Phase:
    return max(phases, key=lambda p: p.bytes)


def _gw(V: int, H: int) -> tuple:
    return ("grad_weight bf16 [V, H]", BF * V * H)


def piece(total: int, most: int) -> int:
    """The largest piece of ``tiling.even_splits(total, most)``."""
    return max((b - a for a, b in tiling.even_splits(total, most)), default=0)


# --- stock Inductor -------------------------------------------------------------------

def stock(T: int, H: int, V: int, loss: str) -> list[Phase]:
    """``loss``: "ce" (cross-entropy; distillation, whose teacher logits are an input) or
    "logprob" (the gathered log-probs)."""
    logits = ("bf16 logits [T, V], saved (their gradient written in place)", BF * T * V)
    end = Phase("backward: grad_hidden, grad_weight", (logits, ("grad_hidden bf16 [T, H]", BF * T * H),
                                                       ("grad_weight bf16 [V, H]", BF * V * H)))
    if loss == "ce":
        return [end]
    gather = ("gather's gradient FP32 [T, V], zero-filled", F4 * T * V)
    return [Phase("backward row kernel", (logits, gather)), end]


# --- ours: the loss in the graph ----------------------------------------------------------

def _kept(T: int, n: int, H: int) -> tuple:
    """The kept rows' gathered hidden states (a mask left ``T - n`` rows out)."""
    return (("hidden of the kept rows bf16 [n, H]", BF * n * H),) if n < T else ()


def loss_gpu(T: int, H: int, V: int, budget: int, n: Optional[int] = None, as_run: bool = False,
             by_device: bool = True) -> list[Phase]:
    """``lm_head_loss``, ``gpu``: ``n`` rows run (the others masked); chunks of
    ``gpu_loss_rows``, each one tile: the logits, their gradient written in their place
    (``as_run``: of ``forward_rows`` with the gradient beside the logits, as the 2026-12-04
    run's code)."""
    n = T if n is None else n
    most = tiling.forward_rows(budget, n, V) if as_run else tiling.gpu_loss_rows(budget, n, V, by_device)
    r = piece(n, most)
    sums = (("grad_weight FP32 sum [V, H]", F4 * V * H), ("grad_hidden FP32 sum [n, H]", F4 * n * H))
    chunk = _loss_tile(r, V, as_run)
    phases = [Phase(f"forward: a chunk of {r} rows", sums + _kept(T, n, H) + chunk)]
    if n < T:
        phases.append(Phase("forward: grad_hidden scattered to every row", sums + _kept(T, n, H)
                            + (("grad_hidden FP32 [T, H]", F4 * T * H),)))
    return phases + [Phase("backward: the sums rounded", (
        ("grad_weight FP32 sum [V, H]", F4 * V * H), ("grad_hidden bf16 [T, H]", BF * T * H),
        ("grad_weight bf16 [V, H]", BF * V * H)))]


def _loss_tile(r: int, V: int, as_run: bool) -> tuple:
    """A chunk of ``lm_head_loss``'s loop: its logits, their gradient written in their place
    (``loss.logits_grad_into``; ``as_run``: beside them, as the 2026-12-04 run's code)."""
    if as_run:
        return ("chunk logits bf16 [r, V]", BF * r * V), ("chunk gradient bf16 [r, V]", BF * r * V)
    return (("chunk logits bf16 [r, V], then their gradient in their place", BF * r * V),)


def loss_two_sweeps(T: int, H: int, V: int, budget: int, as_run: bool = False) -> list[Phase]:
    """``lm_head_loss``, ``two_sweeps`` on a GPU: ``grad_hidden`` in the forward (saved),
    both gradients recomputed in the backward (``lm_head_sweeps.two_sweeps``)."""
    r = piece(T, tiling.forward_rows(budget, T, V))
    made = ("forward's grad_hidden bf16 [T, H], saved", BF * T * H)
    fwd = Phase(f"forward: a chunk of {r} rows", (made, *_loss_tile(r, V, as_run)))
    return [fwd] + [Phase(p.name, (made,) + p.terms) for p in _two_sweeps(T, T, H, V, budget)]


def row_local_gpu(T: int, H: int, V: int, budget: int, n: Optional[int] = None, as_run: bool = False
                  ) -> list[Phase]:
    """``row_local_loss``, ``gpu`` (WD, WDM): the FP32 sums; row chunks of ``sweep_step``
    rows, a chunk's logits with their gradient written in their place (``sweeps.stats_into``;
    the previous chunk's dropped first); the backward
    rounds grad_hidden, its FP32 sum then freed, then grad_weight (NOTE [row-local loss
    memory]).  ``as_run``: the code of the 2026-12-04 run, which held the previous chunk's
    gradient while the next chunk's were made, each chunk's gradient beside its logits, and
    both sums while grad_weight was rounded."""
    n = T if n is None else n
    r = piece(n, tiling.sweep_step(n, V, budget, torch.device("cpu")))
    tile = BF * r * V
    sums = (("grad_weight FP32 sum [V, H]", F4 * V * H), ("grad_hidden FP32 sum [n, H]", F4 * n * H))
    chunk = ((("chunk logits bf16 [r, V]", tile), ("chunk gradient bf16 [r, V]", tile),
              ("the previous chunk's gradient, still bound", tile)) if as_run
             else (("chunk logits bf16 [r, V], their gradient written in their place", tile),))
    teacher = (("the teacher's kept rows of the chunk bf16 [r, V]", tile),) if n < T else ()
    gw32, gh = ("grad_weight FP32 sum [V, H]", F4 * V * H), ("grad_hidden bf16 [T, H]", BF * T * H)
    gh32 = ("grad_hidden FP32 sum [T, H]", F4 * T * H)
    forward = Phase(f"forward: a chunk of {r} rows", sums + _kept(T, n, H) + chunk + teacher)
    if as_run:
        return [forward, Phase("backward: the sums rounded", (gw32, gh32, gh, _gw(V, H)))]
    return [forward, Phase("backward: grad_hidden rounded", (gw32, gh32, gh)),
            Phase("backward: grad_weight rounded", (gw32, gh, _gw(V, H)))]


def row_local_sweeps(T: int, H: int, V: int, budget: int) -> list[Phase]:
    """``row_local_sweeps`` (what a row-local loss keeps where ``tiling.holds_weight_sums``
    says no): the backward's row sweep (``grad_hidden``) then vocabulary blocks over all
    rows (``grad_weight``): a row chunk's logits with their gradient written in their place
    (``sweeps.stats_into``), a block's logits and gradient (``sweeps.row_sweep`` /
    ``block_sweep`` drop the previous piece's before the next is made)."""
    cpu = torch.device("cpu")
    r, c = piece(T, tiling.sweep_step(T, V, budget, cpu)), piece(V, tiling.sweep_step(V, T, budget, cpu))
    gh = ("grad_hidden bf16 [T, H]", BF * T * H)
    two = ("logits", "gradient")
    return [Phase(f"backward row sweep: chunks of {r} rows", (gh, (
                "row chunk logits bf16 [r, V], their gradient written in their place", BF * r * V))),
            Phase(f"backward block sweep: blocks of {c} columns", (gh, _gw(V, H)) + tuple(
                (f"block {w} bf16 [T, c]", BF * T * c) for w in two))]


# --- ours: per token (the lm_head's backward plans) ---------------------------------------

def _two_sweeps(T: int, n: int, H: int, V: int, budget: int) -> list[Phase]:
    rows, cols = tiling.sweep_sizes(budget, n, V)
    r, c = piece(n, rows), piece(V, cols)
    grads = _kept(T, n, H) + (("grad_hidden bf16 [n, H]", BF * n * H), _gw(V, H))
    return [Phase(f"backward row sweep: chunks of {r} rows", grads + (("row chunk gradient bf16 [r, V]",
                                                                      BF * r * V),)),
            Phase(f"backward block sweep: blocks of {c} columns", grads + (("block gradient bf16 [n, c]",
                                                                           BF * n * c),))]


def per_token(T: int, H: int, V: int, plan: str, budget: int, n: Optional[int] = None, as_run: bool = False
              ) -> list[Phase]:
    """``lm_head_stats`` (``lm_head_stats_masked`` for ``n < T`` rows kept) and its backward
    plan: the forward keeps per-row statistics only (a chunk's logits at a time); the
    backward (``lm_head_grads`` on the kept rows) makes ``grad_hidden`` and ``grad_weight``
    first, then sweeps.  ``as_run``: the code of the 2026-12-04 run (``"blocks"`` held the
    previous block's FP32 gradient copy while the next was made)."""
    n = T if n is None else n
    fwd = Phase("forward: a chunk's logits", (("chunk logits bf16 [r, V]",
                                               BF * piece(n, tiling.forward_rows(budget, n, V)) * V),))
    if plan == "two_sweeps":
        return [fwd] + _two_sweeps(T, n, H, V, budget)
    if plan == "kept_logits" and n == T:  # lm_head_kept: the logits from the forward to the backward
        return kept_logits(T, H, V)
    grads = _kept(T, n, H) + (("grad_hidden bf16 [n, H]", BF * n * H), _gw(V, H))
    acc = ("grad_hidden FP32 sum [S, H]", F4 * min(n, tiling.accumulator_rows(budget, n, H)) * H)
    if plan == "gpu":  # gpu_plan.out_dtype_blocks: Inductor writes the gradient over the recomputed logits
        c = piece(V, (gpu_block_cols_2026_12_04 if as_run else tiling.gpu_block_cols)(budget, n, V))
        return [fwd, Phase(f"backward: blocks of {c} columns", grads + (acc, ("block gradient bf16 [n, c]",
                                                                               BF * n * c)))]
    c = piece(V, tiling.backward_tiles(budget, n, V, H, False)[0])  # "blocks": _Backward.sweep
    held = (("the previous block's FP32 copy, still bound", F4 * n * c),) if as_run else ()
    return [fwd, Phase(f"backward: blocks of {c} columns", grads + (
        acc, ("weight block FP32 copy [c, H]", F4 * c * H), ("block gradient bf16 [n, c]", BF * n * c),
        ("block gradient FP32 copy [n, c]", F4 * n * c)) + held)]


def kept_logits(T: int, H: int, V: int) -> list[Phase]:
    """``lm_head_stats_kept`` and ``lm_head_kept.kept_grads``: the forward's chunks write the
    bf16 logits it keeps; the backward writes their gradient in their place and stock's two
    GEMMs read it: stock's cross-entropy's buffers."""
    logits = ("the kept bf16 logits [T, V], their gradient in their place", BF * T * V)
    return [Phase("forward: the kept logits", (logits,)),
            Phase("backward: grad_hidden, grad_weight", (logits, ("grad_hidden bf16 [T, H]", BF * T * H),
                                                         _gw(V, H)))]


# --- the plans a step runs -----------------------------------------------------------------

def ours(case: str, T: int, H: int, V: int, plan: str, budget: int, n: Optional[int] = None,
         as_run: bool = False) -> list[Phase]:
    """Ours for a GPU check case (``W4L``, ``WV``, ``W4C``: the loss in the graph; ``-tok``,
    ``W4E``: per token; ``WD``, ``WDM``: row-local), ``plan`` the mode's, ``n`` the rows run.
    ``as_run``: as the 2026-12-04 run ran it (the FP32 sums held at any T, the loss loop's
    chunks of ``forward_rows``, the row-local loop's and ``"blocks"``' holds); else as built
    now (``tiling.holds_weight_sums``)."""
    held = as_run or tiling.holds_weight_sums(T, V, H, "cuda", STOCK_LOSS.get(case) == "logprob",
                                              row_local=case in ("WD", "WDM"))
    if case in ("WD", "WDM"):
        return row_local_gpu(T, H, V, budget, n, as_run) if held else row_local_sweeps(T, H, V, budget)
    in_graph = case in ("W4L", "WV", "W4C") and plan in ("gpu", "two_sweeps")
    if in_graph and plan == "two_sweeps":
        return loss_two_sweeps(T, H, V, budget, as_run)
    if in_graph and held:
        return loss_gpu(T, H, V, budget, n, as_run)
    return per_token(T, H, V, plan, budget, n, as_run)


def auto_plan(case: str) -> str:
    """The plan ``lm_head_plan="auto"`` runs for an unmasked GPU check case on a GPU:
    ``"kept_logits"`` where stock keeps an FP32 ``[T, V]`` (``tiling.keeps_logits``: the
    log-probs), else ``"gpu"`` (NOTE [lm_head backward plans])."""
    lm_head = case in ("W4L", "W4L-tok", "WV", "WV-tok")
    return "kept_logits" if lm_head and tiling.keeps_logits("cuda", STOCK_LOSS[case] == "logprob") else "gpu"


STOCK_LOSS = {"W4L": "logprob", "W4L-tok": "logprob", "WV": "ce", "WV-tok": "ce", "W4C": "ce", "WD": "ce"}


def ratios(dev, shape: tuple = SHAPE) -> list[dict]:
    """At ``shape`` on ``dev`` with its budget: stock's and ours' peaks (as built) per case,
    and the per-token plan's where the loss in the graph ran another."""
    T, V, H = shape
    budget, out = device_budget(dev), []
    for case in ("W4L", "WV", "WD", "W4L-tok", "WV-tok"):
        base = peak(stock(T, H, V, STOCK_LOSS[case]))
        mine = peak(ours(case, T, H, V, auto_plan(case), budget))
        row = {"case": case, "stock": base, "ours": mine, "ratio": mine.bytes / base.bytes,
               "target": TARGETS.get(case), "plan": auto_plan(case)}
        if case == "W4L":  # lm_head_plan="gpu": the loss loop (its FP32 sums fit under stock's here)
            row["instead"] = peak(ours(case, T, H, V, "gpu", budget)).bytes / base.bytes
        if case == "WV":  # the plan without the FP32 [V, H] sum (one GEMM more)
            row["instead"] = peak(per_token(T, H, V, "gpu", budget)).bytes / base.bytes
        if case == "WD":  # the row-local sweeps (two GEMMs more); the sums' loop as the 2026-12-04 run's code
            row["instead"] = peak(row_local_sweeps(T, H, V, budget)).bytes / base.bytes
            row["as_run"] = peak(row_local_gpu(T, H, V, budget, as_run=True)).bytes / base.bytes
        out.append(row)
    return out


def _mib(x: float) -> str:
    return f"{x / MIB:.0f}"


def report(shape: tuple = SHAPE) -> str:
    T, V, H = shape
    lines = [f"Predicted peak of one step (benchmarks/cost_memory.py), T {T}, V {V}, H {H}, each device's "
             "budget, ours as built / stock:", ""]
    lines += ["| device | case | stock MiB | ours MiB | ours / stock | target | "
              "ours' peak: its buffers, MiB |", "|" + " --- |" * 7]
    for dev in DEVICES:
        for r in ratios(dev, shape):
            big = ", ".join(f"{w} {_mib(b)}" for w, b in sorted(r["ours"].terms, key=lambda t: -t[1]))
            met = r["target"] is not None and r["ratio"] <= r["target"]
            verdict = "met" if met else "**not met**"
            target = "-" if r["target"] is None else f"<= {r['target']}x: {verdict}"
            lines.append(f"| {dev.name} | {r['case']} | {_mib(r['stock'].bytes)} | {_mib(r['ours'].bytes)} | "
                         f"{r['ratio']:.2f}x | {target} | {r['plan']}, {r['ours'].name}: {big} |")
    lines.append("")
    for dev in DEVICES:
        alt = {r["case"]: r["instead"] for r in ratios(dev, shape) if "instead" in r}
        lines.append(f"* {dev.name} (budget {device_budget(dev) // MIB} MiB): W4L with lm_head_plan='gpu' "
                     f"(the loss loop, its FP32 sums) {alt['W4L']:.2f}x; the plans that hold no FP32 "
                     f"[V, H] sum instead: WV {alt['WV']:.2f}x (the per-token gpu "
                     f"plan, one GEMM more), WD {alt['WD']:.2f}x (the row-local sweeps, two GEMMs more); "
                     f"WD with the row-local loop's two holds of the 2026-12-04 run's code (the previous "
                     f"chunk's gradient, grad_hidden's FP32 sum while grad_weight is rounded): "
                     f"{next(r['as_run'] for r in ratios(dev, shape) if r['case'] == 'WD'):.2f}x")
    return "\n".join(lines)


# --- against a recorded run ------------------------------------------------------------------

BOUND = 0.10  # predicted within 10% of a measured peak
NOT_MODELLED = {
    "RO": "reduce-overhead: the step replays CUDA graphs whose private pool was allocated at capture, "
          "before the step (peak_mib about 0)",
    "WP": "top-p over given logits (no lm_head): not modelled",
    "VP": "the vocab-parallel loops: not modelled",
    "W4E": "stock: Inductor's CUDA code for the entropy metric (measured 10 T V bytes; its CPU code holds "
           "8 T V, so the CPU cannot show which buffers): not modelled",
    "WDM": "stock: Inductor's CUDA code for the masked mean (measured three bf16 [T, V]; not read): "
           "not modelled",
}


def predicted(case: str, mode: str, T: int, V: int, H: int, counters: dict, budget: int) -> Optional[Phase]:
    """The model's peak for a recorded row as that run ran it, or None (``NOT_MODELLED``)."""
    base, _, variant = mode.partition(":")
    if case in ("RO", "WP", "VP") or (base == "inductor" and case not in STOCK_LOSS):
        return None
    if base == "inductor":
        return peak(stock(T, H, V, STOCK_LOSS[case]))
    n = T - counters.get("rows_skipped", 0)
    plan = variant if variant in ("gpu", "blocks", "two_sweeps") else "gpu"
    if case in ("W4L-tok", "WV-tok", "W4E"):
        return peak(per_token(T, H, V, plan, budget, n, as_run=True))
    return peak(ours(case, T, H, V, plan, budget, n, as_run=True))


def measured(run_dir: pathlib.Path) -> dict:
    """{(case, T, mode): (peak MiB, V, H, counters)} of a gpu_check run's ``run*.json`` (the
    peaks are the same in every run that measured a row: the first is kept)."""
    out: dict = {}
    for path in sorted(pathlib.Path(run_dir).glob("run*.json")):
        for row in json.loads(path.read_text())["rows"]:
            if row.get("peak_mib") is not None:
                out.setdefault((row["case"], row["T"], row["mode"]),
                               (row["peak_mib"], row["V"], row["H"], row.get("chunked_logits") or {}))
    return out


def compare(run_dir: pathlib.Path, budget: int) -> list[dict]:
    rows = []
    for (case, T, mode), (mib, V, H, counters) in sorted(measured(run_dir).items()):
        got = predicted(case, mode, T, V, H, counters, budget)
        rows.append({"case": case, "T": T, "mode": mode, "measured": mib, "phase": got,
                     "ratio": got.bytes / MIB / mib if got and mib > 1 else None})
    return rows


def compare_table(run_dir: pathlib.Path, budget: int) -> str:
    lines = [f"Peak memory of one step, predicted (benchmarks/cost_memory.py, as the run ran: its code's "
             f"chunks and holds, budget "
             f"{budget // MIB} MiB) / measured ({run_dir}):", "",
             "| case | T | mode | measured MiB | predicted MiB | predicted / measured | the peak |",
             "|" + " --- |" * 7]
    for r in compare(run_dir, budget):
        if r["phase"] is None:
            why = NOT_MODELLED.get(r["case"], "not modelled")
            lines.append(f"| {r['case']} | {r['T']} | {r['mode']} | {r['measured']:.1f} | - | - | {why} |")
            continue
        flag = "" if abs(r["ratio"] - 1) <= BOUND else " **off**"
        lines.append(f"| {r['case']} | {r['T']} | {r['mode']} | {r['measured']:.1f} | "
                     f"{r['phase'].bytes / MIB:.1f} | {r['ratio']:.3f}{flag} | {r['phase'].name} |")
    return "\n".join(lines)
