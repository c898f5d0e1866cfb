"""The kernels of one step, per path, for the cost model (``benchmarks/cost_model.py``).

``stock``: stock Inductor's kernels (its generated code read on the CPU at small size);
``ours``: chunked_logits' loops at a chunk budget, the sizes from ``fx_passes.kernels.tiling``:
the forward loop, each lm_head backward plan (``BACKWARDS``), the loss-in-graph loops
(``GIF``; ``GIF_2026_12_04``: as the recorded H200 run ran them) and ``masked``, the rows a
loss leaves out.  Each returns a list of :class:`cost_roofline.Kernel`.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from typing import Callable, Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cost_roofline import BF16, FP32, SIZE, Kernel, elementwise, fresh, gemm  # noqa: E402
from fx_passes.kernels import tiling  # noqa: E402

# --- stock Inductor -------------------------------------------------------------------

def stock(T: int, H: int, V: int, loss: str) -> list[Kernel]:
    """Stock Inductor's kernels (its C++ code; the backward's gradient reuses the logits'
    buffer when the lm_head made them)."""
    ks = [gemm("logits", (T, H, V), new=True)] if H else []
    ks.append(elementwise("forward row reduction", 2 * T * V, exps=T * V))
    grad_new = 0 if H else 2 * T * V
    if loss == "logprob":  # gather's gradient: an FP32 [T, V] buffer, zero-filled, then read
        ks += [elementwise("zero-fill FP32 [T, V]", 0, 4 * T * V, new=4 * T * V),
               elementwise("backward row kernel", 6 * T * V, 2 * T * V, exps=T * V, new=grad_new)]
    else:
        ks.append(elementwise("backward row kernel", 2 * T * V, 2 * T * V, exps=T * V, new=grad_new))
    if H:
        ks += [gemm("grad_hidden", (T, V, H), new=True), gemm("grad_weight", (V, T, H), new=True)]
    return ks


# --- chunked_logits ---------------------------------------------------------------------

def splits(total: int, most: int) -> list[int]:
    """The piece sizes of ``tiling.even_splits``."""
    return [b - a for a, b in tiling.even_splits(total, most)]


def tile(what: str, rows: int, cols: int, H: int, backward: bool, dtype: str = BF16) -> list[Kernel]:
    """A logits tile's GEMM and the body that reduces it (and writes its gradient); a
    backward tile's GEMM is one of a recompute sweep (``Device.sweep_eff``)."""
    out = BF16 if dtype == BF16 else FP32
    body = elementwise(f"{what} body", SIZE[out] * rows * cols, 2 * rows * cols if backward else 0,
                       exps=rows * cols)
    return [gemm(f"{what} logits", (rows, H, cols), dtype, out, sweep=backward), body]


def forward_loop(budget: int, T: int, H: int, V: int) -> list[Kernel]:
    """``lm_head._forward_loop``: chunks of ``forward_rows`` rows, the last one shorter."""
    ks, rows = [], tiling.forward_rows(budget, T, V)
    for r0 in range(0, T, rows):
        ks += tile("forward", min(T, r0 + rows) - r0, V, H, backward=False)
    return ks


def two_sweeps(budget: int, T: int, H: int, V: int) -> list[Kernel]:
    rows, cols = tiling.sweep_sizes(budget, T, V)
    ks = []
    for r in splits(T, rows):
        ks += tile("recompute rows", r, V, H, True) + [gemm("grad_hidden", (r, V, H), sweep=True)]
    for c in splits(V, cols):
        ks += tile("recompute block", T, c, H, True) + [gemm("grad_weight", (c, T, H), sweep=True)]
    return ks


def gpu(budget: int, T: int, H: int, V: int, block_cols: Optional[Callable] = None) -> list[Kernel]:
    """``gpu_plan.out_dtype_blocks``: blocks over all rows (of ``block_cols`` columns, None:
    ``tiling.gpu_block_cols``), ``grad_hidden`` summed in FP32 through ``out_dtype`` per
    group of rows."""
    ks, block_cols = [], block_cols or tiling.gpu_block_cols
    for i, g in enumerate(splits(T, tiling.accumulator_rows(budget, T, H))):
        n = T if i == 0 else g  # the first sweep reads every row for grad_weight
        for j, c in enumerate(splits(V, block_cols(budget, n, V))):
            ks += tile("recompute block", n, c, H, True)
            if i == 0:
                ks.append(gemm("grad_weight", (c, n, H), sweep=True))
            # (the first block's GEMM writes the FP32 sum, every later one adds into it)
            ks.append(gemm("grad_hidden (out_dtype FP32)", (g, c, H), out=FP32, acc=j > 0, sweep=True))
        ks.append(elementwise("grad_hidden FP32 -> bf16", 4 * g * H, 2 * g * H))
    return ks


def gpu_block_cols_2026_12_04(budget: int, n: int, V: int) -> int:
    """``tiling.gpu_block_cols`` as the 2026-12-04 run's code cut the blocks: the budget's
    columns rounded down to the granule (at T 8192, V 151936: 37888, under V / 4, so 5
    blocks where 4 even ones hold)."""
    return tiling.aligned(min(V, max(1, min(budget, n * V)) // (4 * n))) if n else max(1, V)


def gpu_2026_12_04(budget: int, T: int, H: int, V: int) -> list[Kernel]:
    """``gpu`` as the 2026-12-04 run ran it (``gpu_block_cols_2026_12_04``)."""
    return gpu(budget, T, H, V, gpu_block_cols_2026_12_04)


def blocks(budget: int, T: int, H: int, V: int, fp32: bool = False) -> list[Kernel]:
    """``lm_head_sweeps._Backward.sweep`` per group of rows (``fp32``: the ``fp32_tiles`` plan)."""
    ks, dt = [], FP32 if fp32 else BF16
    for i, (r0, r1) in enumerate(tiling.even_splits(T, tiling.accumulator_rows(budget, T, H))):
        first, last = (0, T) if i == 0 else (r0, r1)  # the first sweep reads every row for grad_weight
        cols, rows = tiling.backward_tiles(budget, last - first, V, H, fp32)
        for c in splits(V, cols):
            ks.append(elementwise("weight block -> FP32", 2 * c * H, 4 * c * H))
            for t0, t1 in tiling.even_splits(last - first, rows):
                r, a = t1 - t0, min(t1 + first, r1) - max(t0 + first, r0)  # a: rows this group sums
                if fp32:
                    ks.append(elementwise("hidden tile -> FP32", 2 * r * H, 4 * r * H))
                ks += tile("recompute tile", r, c, H, True, dt)
                ks.append(elementwise("gradient tile -> FP32", 2 * r * c, 4 * r * c))
                if i == 0:
                    ks.append(gemm("grad_weight", (c, r, H), dt, dt, acc=fp32, sweep=True))
                if a > 0:
                    ks.append(gemm("grad_hidden (FP32)", (a, c, H), FP32, FP32, acc=True, sweep=True))
            if fp32 and i == 0:
                ks.append(elementwise("grad_weight block -> bf16", 4 * c * H, 2 * c * H))
        ks.append(elementwise("grad_hidden FP32 -> bf16", 4 * (r1 - r0) * H, 2 * (r1 - r0) * H))
    return ks


def _gif_chunks(budget: int, T: int, H: int, V: int, out: str) -> list[Kernel]:
    """``lm_head_loss._loop``'s row chunks: logits and stats, the gradient tile, and
    ``grad_hidden[chunk]`` in one GEMM (FP32 output on the ``gpu`` plan)."""
    ks = []
    for r in splits(T, tiling.forward_rows(budget, T, V)):
        ks += tile("forward", r, V, H, backward=False)
        ks += [elementwise("gradient body", 2 * r * V, 2 * r * V, exps=r * V),
               gemm("grad_hidden", (r, V, H), out=out)]
    return ks


def gif_gpu(budget: int, T: int, H: int, V: int, kind: str = "cuda", by_device: bool = True) -> list[Kernel]:
    """``lm_head_loss``, ``gpu`` (``gpu_plan.fp32_chunk_grads``): 3 GEMMs over at most
    ``tiling.MAX_LOSS_CHUNKS`` row chunks; per chunk the logits GEMM, one kernel for the
    stats, the tail and the gradient written over the logits (``loss.chunk_body``: its
    reduction loops and its gradient loop each read the logits, here from device memory, as
    the rows in flight outgrow the L2; one launch, not two), ``grad_hidden`` written in FP32
    by its GEMM, the FP32 ``[V, H]`` ``grad_weight`` written by the first chunk's GEMM and
    added to inside every later one; the backward scales both FP32 gradients and rounds them
    (``by_device``: the device's budget, else one the user set)."""
    ks = []
    for i, r in enumerate(splits(T, tiling.gpu_loss_rows(budget, T, V, by_device))):
        ks += [gemm("forward logits", (r, H, V)),
               elementwise("chunk body: stats, tail, gradient", 4 * r * V, 2 * r * V, exps=2 * r * V),
               gemm("grad_hidden (out_dtype FP32)", (r, V, H), out=FP32),
               gemm("grad_weight (out_dtype FP32)", (V, r, H), out=FP32, acc=i > 0)]
    return ks + _scaled(T, H, V)


def gif_gpu_2026_12_04(budget: int, T: int, H: int, V: int, kind: str = "cuda", by_device: bool = True
                       ) -> list[Kernel]:
    """``gif_gpu`` as the H200 run of 2026-12-04 ran it: the budget's chunks
    (``forward_rows``), an FP32 ``[V, H]`` buffer zero-filled, then each chunk's
    ``g.t() @ h`` added into it (``out_dtype``, ``out=``) in blocks of ``budget / 4H``
    columns, ``grad_hidden[chunk]`` an FP32 product copied into its buffer."""
    ks, cols = _gif_chunks(budget, T, H, V, FP32), max(1, min(V, budget // (4 * H)))
    ks.append(elementwise("zero-fill FP32 [V, H]", 0, 4 * V * H))
    for r in splits(T, tiling.forward_rows(budget, T, V)):
        ks.append(elementwise("grad_hidden FP32 product -> its buffer", 4 * r * H, 4 * r * H))
        for c in splits(V, cols):
            ks.append(gemm("grad_weight (out_dtype FP32)", (c, r, H), out=FP32, acc=True))
    return ks + _scaled(T, H, V)


def _scaled(T: int, H: int, V: int) -> list[Kernel]:
    """The backward's ``(grad * g).to(bf16)`` of both FP32 gradients: traced into the
    compiled backward graph, where Inductor fuses it into one kernel per gradient (read
    on the CPU: one ``cpp_fused__to_copy_mul`` kernel, no FP32 temporary)."""
    n = (T + V) * H
    scaled = elementwise("backward: gradients x g, rounded to bf16 (one fused kernel)", 4 * n, 2 * n)
    return [dataclasses.replace(scaled, fresh=fresh(2 * T * H) + fresh(2 * V * H))]


def gif_two_sweeps(budget: int, T: int, H: int, V: int, kind: str = "cuda", by_device: bool = True
                   ) -> list[Kernel]:
    """``lm_head_loss``, ``two_sweeps``: ``grad_hidden`` in the forward; on a CPU (unit
    incoming gradient, read with ``.item()``) one vocabulary sweep for ``grad_weight`` in
    the backward: 4 GEMMs; elsewhere (no host read of ``g``) the backward recomputes
    both gradients, a sweep each: 6 GEMMs (``loss._sweeps_backward``)."""
    ks = _gif_chunks(budget, T, H, V, BF16)
    if kind != "cpu":
        return ks + two_sweeps(budget, T, H, V)
    for c in splits(V, tiling.sweep_sizes(budget, T, V)[1]):
        ks += tile("recompute block", T, c, H, True) + [gemm("grad_weight", (c, T, H), sweep=True)]
    return ks + [elementwise("backward: grad_hidden clone", 2 * T * H, 2 * T * H, new=2 * T * H)]


def kept_forward(budget: int, T: int, H: int, V: int, kind: str = "cuda", by_device: bool = True
                 ) -> list[Kernel]:
    """``lm_head_kept._fill``: per row chunk (``tiling.kept_rows``: one on a GPU with its
    budget) the logits GEMM writes its rows of the kept buffer, then one body reads them."""
    ks = []
    for r in splits(T, tiling.kept_rows(budget, T, V, kind, by_device)):
        ks += tile("forward", r, V, H, backward=False)
    return ks


def kept_logits(budget: int, T: int, H: int, V: int, kind: str = "cuda", by_device: bool = True
                ) -> list[Kernel]:
    """``lm_head_kept.kept_grads``: per row chunk of the forward's kept logits
    (``tiling.kept_rows``) one row kernel reads them and writes their gradient in their
    place; then ``grad_hidden`` and ``grad_weight`` one GEMM each over all rows (stock's).
    No logits GEMM, no FP32 sum: 3 GEMMs a step with the forward's."""
    return kept_grads(splits(T, tiling.kept_rows(budget, T, V, kind, by_device)), T, H, V)


def kept_grads(rows: list[int], T: int, H: int, V: int) -> list[Kernel]:
    """Per chunk of ``rows`` one row kernel writing the gradient over the kept logits, then
    ``grad_hidden`` and ``grad_weight`` one GEMM each over all rows."""
    ks = [elementwise("gradient over the kept logits", 2 * r * V, 2 * r * V, exps=r * V) for r in rows]
    return ks + [gemm("grad_hidden", (T, V, H)), gemm("grad_weight", (V, T, H))]


def gif_kept_logits(budget: int, T: int, H: int, V: int, kind: str = "cuda", by_device: bool = True
                    ) -> list[Kernel]:
    """``lm_head_plan="kept_logits"`` with the loss in the graph: no loss loop, the loss stays
    in the graph on the per-token call that keeps its logits (``rewrite/loss_tail._plan``;
    the tail's per-row ops, a few ``[T]`` vectors, left out): ``kept_forward`` and
    ``kept_logits``."""
    return kept_forward(budget, T, H, V, kind, by_device) + kept_logits(budget, T, H, V, kind, by_device)


BACKWARDS: dict[str, Callable] = {"gpu": gpu, "blocks": blocks, "two_sweeps": two_sweeps,
                                  "fp32_tiles": lambda b, T, H, V: blocks(b, T, H, V, fp32=True),
                                  "kept_logits": kept_logits}
GIF: dict[str, Callable] = {"gpu": gif_gpu, "two_sweeps": gif_two_sweeps, "kept_logits": gif_kept_logits}
GIF_2026_12_04: dict[str, Callable] = {"gpu": gif_gpu_2026_12_04, "two_sweeps": gif_two_sweeps}  # as measured
BACKWARDS_2026_12_04: dict[str, Callable] = {**BACKWARDS, "gpu": gpu_2026_12_04}  # as measured


# --- the vocab-parallel one-pass loop, on one rank ---------------------------------------

# The all-reduces per row chunk of ``examples/vocab_parallel_step.py``'s token log-prob (the
# max, the sum of exponentials, the picked logit): a kernel each, on a ``[rows]`` vector.
VP_COLLECTIVES = 3


def _all_reduce(n: int) -> Kernel:
    return elementwise("all-reduce of a [rows] vector", 4 * n, 4 * n)


def stock_vocab_parallel(T: int, H: int, V: int) -> list[Kernel]:
    """Stock Inductor on the vocab-parallel token log-prob (VP, one rank): stock's token
    log-prob kernels, a second read of the logits (the max's pass: its all-reduce stands
    between it and the sum of exponentials) and the all-reduces on ``[T]``."""
    return (stock(T, H, V, "logprob") + [elementwise("forward: the max's pass", 2 * T * V)]
            + [_all_reduce(T)] * VP_COLLECTIVES)


def vocab_parallel(budget: int, T: int, H: int, V: int, plan: str, backwards: Optional[dict] = None
                   ) -> list[Kernel]:
    """``distributed/one_pass``'s loop on one rank (its shard the whole vocabulary): row
    chunks as ``one_pass._splits`` cuts them; per chunk the logits GEMM, the two stages'
    bodies (the max; the sum of exponentials and the picked logit), each reading the tile,
    and the all-reduces between them; then the backward's loops for ``plan``
    (``shard.backward_loops``: ``"gpu"`` on CUDA / XPU; the 2026-12-04 run's code ran
    ``"two_sweeps"`` on every device; ``"kept_logits"``: ``kept_stages``, the forward's
    GEMMs writing the kept logits, the backward's row kernels and two GEMMs)."""
    count = len(tiling.even_splits(T, tiling.sweep_sizes(budget, T, V)[0]))
    ks, rows = [], splits(T, -(-T // count))
    for r in rows:
        ks += [gemm("forward logits", (r, H, V)), elementwise("stage body: the max", 2 * r * V),
               _all_reduce(r), elementwise("stage body: exponentials' sum, picked", 2 * r * V, exps=r * V)]
        ks += [_all_reduce(r)] * (VP_COLLECTIVES - 1)
    if plan == "kept_logits" and backwards is None:  # (kept_stages: the forward's chunks)
        return ks + kept_grads(rows, T, H, V) + _outputs(T, H, V, 2)
    return ks + (backwards or BACKWARDS)[plan](budget, T, H, V) + _outputs(T, H, V, 2)


@dataclasses.dataclass(frozen=True)
class Build:
    """How the modelled loops are built: ``kind``, the device's (``Device.kind``); ``gif``,
    the loss-in-graph loops (None: ``GIF``, as built; ``GIF_2026_12_04``: as measured then);
    ``by_device``: the budget is the device's (else one the user set); ``backwards``: the
    per-token backward plans (None: ``BACKWARDS``; ``BACKWARDS_2026_12_04``: as measured)."""

    kind: str = "cuda"
    gif: Optional[dict] = None
    by_device: bool = True
    backwards: Optional[dict] = None


def ours(T: int, H: int, V: int, plan: str, in_forward: bool, budget: int, build: Build = Build()
         ) -> list[Kernel]:
    """chunked_logits' kernels, built as ``build`` says."""
    if not H:  # W3: row_stats over the given logits
        return [elementwise("forward row reduction", 2 * T * V, exps=T * V),
                elementwise("backward pointwise", 2 * T * V, 2 * T * V, exps=T * V, new=2 * T * V)]
    if in_forward:
        loops = (build.gif or GIF)[plan](budget, T, H, V, build.kind, build.by_device)
        return loops + _outputs(T, H, V, 4 if plan == "gpu" else 2)
    if plan == "kept_logits":
        return gif_kept_logits(budget, T, H, V, build.kind, build.by_device) + _outputs(T, H, V, 2)
    return forward_loop(budget, T, H, V) + (build.backwards or BACKWARDS)[plan](budget, T, H, V) + _outputs(
        T, H, V, 2)


def as_built(T: int, H: int, V: int, plan: str, loss: str, in_graph: bool, budget: int, fraction: float = 0.0,
             replay: bool = False) -> tuple[list[Kernel], float]:
    """(the kernels, the host reads' seconds) of an lm_head step as the rewrites build it on a
    GPU, ``plan`` forced (``"auto"``'s: ``tiling.keeps_logits``): rows a mask leaves out
    (``fraction``) are left out after one host read, and a masked loss keeps its own loop
    (no logits kept: a forced ``"kept_logits"`` runs the device's plan there); the loss
    stays in the loss loop where ``plan`` has one and, for ``"gpu"``, its FP32 sums fit
    under stock's peak (``tiling.holds_weight_sums``), else the per-token call runs it.
    ``replay`` (``mode="reduce-overhead"``): a capture-safe loss loop replays every row (no
    host read inside a capture); the per-token masked op, which is not, runs between the
    captured parts."""
    loop = in_graph and plan in ("gpu", "two_sweeps") and (
        plan != "gpu" or tiling.holds_weight_sums(T, V, H, "cuda", loss == "logprob"))
    if replay and loop:
        return masked(T, H, V, plan, budget, 0.0), 0.0
    if fraction:
        plan = "gpu" if plan == "kept_logits" else plan
        return masked(T, H, V, plan, budget, fraction, in_forward=loop), SYNC_S
    return ours(T, H, V, plan, loop or (in_graph and plan == "kept_logits"), budget), 0.0


def _outputs(T: int, H: int, V: int, size: int) -> list[Kernel]:
    """The gradients' own buffers (the loops write them in place: only their allocation
    costs, where it is ``fresh``)."""
    return [Kernel("gradient buffers", fresh=fresh(size * T * H) + fresh(size * V * H))]


# A device sync's price (the one host read of ``kernels/rows.select``): the GPU drains its
# queue, then idles while the op's Python prologue runs before the next kernel.  An
# assumption (tens to hundreds of microseconds), not measured: docs/gpu.md.
SYNC_S = 100e-6


def masked(T: int, H: int, V: int, plan: str, budget: int, fraction: float, in_forward: bool = True,
           build: Build = Build()) -> list[Kernel]:
    """``lm_head_loss`` (``in_forward``; else the per-token ``lm_head_stats_masked``) with
    ``fraction`` of the rows left out of the loss (section 5c of docs/how-it-works.md): the
    logits' bound (a read of ``[T, H]`` and ``[V, H]``), the gather of the kept rows, the
    loop on them (their count rounded up to the granule), the scatter of ``grad_hidden``,
    and the one host read."""
    n = min(T, -(-round(T * (1 - fraction)) // tiling.granule(T)) * tiling.granule(T))
    size = 4 if plan == "gpu" and in_forward else 2
    ks = [elementwise("bound: |h| per row, max |W|", 2 * (T + V) * H),
          elementwise("gather kept rows", 2 * n * H, 2 * n * H)]  # (the host read: SYNC_S)
    if in_forward:
        ks += (build.gif or GIF)[plan](budget, n, H, V, build.kind, build.by_device) if n else []
    else:
        backward = (build.backwards or BACKWARDS)[plan]
        ks += forward_loop(budget, n, H, V) + backward(budget, n, H, V) if n else []
    ks += [elementwise("scatter grad_hidden (zeros + kept rows)", size * n * H, size * T * H)]
    return ks + _outputs(T, H, V, size)
