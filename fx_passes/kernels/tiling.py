"""How the lm_head loop cuts its work: rows per forward chunk, vocabulary blocks and
row tiles of the backward, rows per FP32 ``grad_hidden`` accumulator.

Every size comes from one working-set budget (``Config.chunk_budget_mib``), so the
memory the loop needs above the model-precision gradients is bounded by the budget,
whatever T and V are.  Unset, the budget is the device's (``device_budget``): a pure
function of the device kind and its total memory (never of the memory free at the
call), so every step and every rank cuts the same chunks.  Pieces are multiples of
``ALIGN`` (128) rows or columns but the last where the budget holds 1024 or more, of 8
where it holds 64 or more (rounding 221 rows down to 128 would cost 42% of the chunk:
GEMM tiles and ``grad_weight`` column slices at aligned offsets either way).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from .. import compat
from ..reporting.report import say_once

__all__ = ["forward_rows", "kept_rows", "gpu_loss_rows", "MAX_LOSS_CHUNKS", "holds_weight_sums",
           "keeps_logits", "weight_sums_why", "backward_tiles", "gpu_block_cols",
           "sweep_sizes", "accumulator_rows",
           "even_splits", "aligned", "granule", "backward_plan", "BY_DEVICE", "device_budget",
           "resolve_budget", "ALIGN", "chunk_rows", "sweep_step", "product_cols", "spans",
           "BYTES_PER_ELEMENT", "SWEEP_BYTES_PER_ELEMENT"]

log = logging.getLogger("fx_passes")

MIB = 2**20
BY_DEVICE = 0  # budget_bytes of a Config without chunk_budget_mib: the device's (device_budget)
CPU_BUDGET = 32 * MIB
GPU_SHARE = 64  # a GPU's budget: 1/64 of its total memory (a whole MiB),
GPU_MIN, GPU_MAX = 256 * MIB, 2048 * MIB  # within these
ALIGN, SMALL_ALIGN = 128, 8  # rows / columns a piece is a multiple of (all but the last): granule()


def device_budget(device_type: str, total_bytes: Optional[int]) -> int:
    """The working-set budget of the chunk loops when none is configured: 32 MiB on a
    CPU (the size its caches and the measured tables were tuned at); on a GPU
    (``"cuda"``, ``"xpu"``) 1/64 of its total memory, within 256 MiB and 2 GiB (an H200
    or H100: 2 GiB / 1.2 GiB; a 24 GiB card 384 MiB; total unknown: 256 MiB).  Total
    memory, not free: the caching allocator's reserved blocks and a colocated rollout
    engine make free memory small and different on every step and rank (docs/gpu.md,
    "Chunk budget").  (The loops also hold at most a quarter of the FP32 logits per
    chunk: ``_budget``.)"""
    if device_type not in ("cuda", "xpu"):
        return CPU_BUDGET
    if not total_bytes:
        return GPU_MIN
    return max(GPU_MIN, min(GPU_MAX, total_bytes // GPU_SHARE // MIB * MIB))


def resolve_budget(budget_bytes: int, device: torch.device) -> int:
    """``budget_bytes``, or the device's budget (``device_budget``) for ``BY_DEVICE``."""
    if budget_bytes != BY_DEVICE:
        return budget_bytes
    return device_budget(device.type, compat.total_device_bytes(device))


def granule(count: int) -> int:
    """What a piece of at most ``count`` rows / columns is a multiple of: ``ALIGN`` from
    1024 on, 8 from 64 on (rounding down loses at most 1/8 either way), else 1."""
    return ALIGN if count >= 8 * ALIGN else SMALL_ALIGN if count >= 8 * SMALL_ALIGN else 1


def aligned(count: int) -> int:
    """``count`` (rows or columns a piece may hold) rounded down to a multiple of its
    ``granule`` (at least 1)."""
    return max(1, count // granule(count) * granule(count))


def _budget(budget_bytes: int, n: int, vocab: int) -> int:
    """The configured working set, but never more than a quarter of the FP32 logits:
    a small problem gets several chunks too, instead of one chunk bigger than stock.
    (``BY_DEVICE`` not resolved by the caller: the CPU's budget, not 1-row chunks.)"""
    return max(1, min(budget_bytes or CPU_BUDGET, n * vocab))


def forward_rows(budget_bytes: int, n: int, vocab: int) -> int:
    """Rows per forward chunk: one FP32 ``[rows, V]`` chunk fills the budget."""
    return aligned(_budget(budget_bytes, n, vocab) // (4 * vocab))


def kept_rows(budget_bytes: int, n: int, vocab: int, device_type: str, by_device: bool = True,
              transforms: str = "") -> int:
    """Rows per chunk of the ``"kept_logits"`` loops (NOTE [kept logits]): on a GPU with
    the device's budget (``by_device``) all ``n`` rows in one chunk, whose logits GEMM is
    stock's own over every row and whose two row kernels (the stats, the gradient written
    in place) read the kept buffer with no ``[r, V]`` temporary, so a chunk holds nothing
    the kept logits do not (each more chunk costs the GPU a smaller GEMM and two launches:
    NOTE [gpu loss chunks]); elsewhere, with a budget the user set, or with logit
    ``transforms`` (a soft cap's tanh, which Inductor keeps in an FP32 tile that the stats
    read twice: tests/test_kept_logits.py reads the code), ``forward_rows``."""
    if device_type != "cpu" and by_device and not transforms:
        return max(1, n)
    return forward_rows(budget_bytes, n, vocab)


# NOTE [gpu loss chunks]
# The ``"gpu"`` loss loop (``log_softmax/loss.py``; ``gpu_plan.fp32_chunk_grads``) holds an
# FP32 ``[V, H]`` ``grad_weight`` sum that every row chunk's GEMM reads and writes once
# more (8 V H bytes in its epilogue).  On the H200 run of 2026-12-04 (T 8192, V 151936,
# H 4096: ``benchmarks/cost_measured.py --breakdown``, docs/gpu.md "Where the time goes")
# its 4 chunks of 2048 rows took 42.4 ms of GEMMs against stock's 39.2 (smaller GEMMs:
# 698 TFLOPS against stock's 786): that pass (5 GB, about 1 ms) and the chunk's kernels
# (130 us each in the fitted model) are the price of a chunk, and at T 16384 the budget
# made 5.  Issue 54's peers measured the same: Liger's loop +7.6% at 4 chunks of 2048
# rows, best at 2 of 4096.  So, with the device's budget, the loop runs
# ``MAX_LOSS_CHUNKS`` (2) chunks at any T: a chunk's gradient is written over its logits
# (``loss.logits_grad_into``: 2 bytes an element), so a chunk of ``T / 2`` rows holds
# ``T V`` bytes, half the bf16 logits stock keeps, as ``T / 4`` rows with a separate
# gradient did: the loop never holds more than stock where stock holds more than the FP32
# sums (T >= 2 H; ``weight_sums_peaks``).  The accumulator then moves 12 V H bytes a step
# (the first GEMM writes it, the second reads and writes it), not 28, in 2 GEMMs of 4096
# rows; the model (``benchmarks/cost_model.py``, W4L-8k on the H200): 1.01x stock, 1.09x
# at 4 chunks.  A budget the user sets (``chunk_budget_mib``) bounds the chunk as
# everywhere else (``forward_rows``).
MAX_LOSS_CHUNKS = 2


def gpu_loss_rows(budget_bytes: int, n: int, vocab: int, by_device: bool = True) -> int:
    """Rows per chunk of the ``"gpu"`` loss loop (NOTE [gpu loss chunks]): ``n /
    MAX_LOSS_CHUNKS`` rounded up to the granule with the device's budget (``by_device``),
    else the budget's rows (``forward_rows``)."""
    if not by_device:
        return forward_rows(budget_bytes, n, vocab)
    fewest = max(1, -(-n // MAX_LOSS_CHUNKS))
    unit = granule(fewest)
    return -(-fewest // unit) * unit


# NOTE [FP32 weight sums and stock's memory]
# The ``"gpu"`` loss in the graph keeps FP32 ``grad_weight`` and ``grad_hidden`` sums
# (``4 V H + 4 T H`` bytes) from the forward to the backward, and beside them, in the
# forward, a chunk's model-precision logits, its gradient written in their place (``2 r V``,
# ``r`` rows: ``gpu_loss_rows``), in the backward the model-precision gradients it rounds them into
# (``2 V H + 2 T H``).  Stock keeps the model-precision logits (``2 T V``), with either
# the FP32 ``[T, V]`` the region upcasts (``4 T V``: a log-prob's gather reads it; a
# cross-entropy alone keeps none, its kernels fuse the upcast) or its own gradients
# (``2 V H + 2 T H``), whichever is more.  The region holds the sums only where its peak
# is at most stock's; else it keeps the plan that holds no ``[V, H]`` sum: vocabulary
# blocks outermost, each ``grad_weight`` block one GEMM over all rows written once
# (``gpu_plan.out_dtype_blocks``; a row-local region keeps its sweeps), at one GEMM more.
# The recorded H200 run of 2026-12-04: WD (T 4096 = H) 1.52x stock's peak with the sums;
# the cross-entropy WV at T 8192 = 2 H 1.00x measured with its ignored rows left out, 1.02x
# by the memory model with every row (``benchmarks/cost_memory.py``): over stock, so the
# cross-entropy alone takes the sums from about 2.1 H rows on, a log-prob from about 1.03 H.
# A row-local loss (``row_local=True``) frees a chunk's tiles and its ``grad_hidden`` sum
# before it rounds ``grad_weight`` (NOTE [row-local loss memory]): its peak is the
# backward's ``6 V H + 2 T H``, stock's gradients' peak exactly at T = 2 H.
# The rule reads the sizes, what stock keeps and the device only; on a CPU (whose plans
# hold no such sums; ``"gpu"`` forced there runs the test-only kernels) it never applies.


def weight_sums_peaks(rows: int, vocab: int, width: int, stock_fp32: bool = False,
                      row_local: bool = False) -> tuple[int, int]:
    """(ours, stock): the peak bytes of the ``"gpu"`` loss in the graph holding its FP32
    sums, and stock's, for 16-bit logits (NOTE [FP32 weight sums and stock's memory]);
    ``stock_fp32``: stock keeps the region's FP32 ``[T, V]``; ``row_local``: the
    row-local loss's loop."""
    grads = 2 * vocab * width + 2 * rows * width
    if row_local:
        ours = 4 * vocab * width + grads
    else:
        ours = 4 * vocab * width + 4 * rows * width + max(2 * gpu_loss_rows(0, rows, vocab) * vocab, grads)
    stock = 2 * rows * vocab + max(4 * rows * vocab if stock_fp32 else 0, grads)
    return ours, stock


def holds_weight_sums(rows, vocab: int, width: int, device_type: str, stock_fp32: bool = False,
                      row_local: bool = False) -> bool:
    """May the ``"gpu"`` loss in the graph hold its FP32 ``[V, H]`` sums on this device
    (NOTE [FP32 weight sums and stock's memory])?  ``rows``: T, or None where it is not
    known at compile time (dynamic: as before, they are held); ``stock_fp32``: stock keeps
    the region's FP32 ``[T, V]`` (False: a cross-entropy alone, or not known);
    ``row_local``: the row-local loss's loop.  Not on a CPU (whose plans hold none)."""
    if device_type == "cpu" or not isinstance(rows, int):
        return True
    ours, stock = weight_sums_peaks(rows, vocab, width, stock_fp32, row_local)
    return ours <= stock


def weight_sums_why(rows: int, vocab: int, width: int, stock_fp32: bool = False, row_local: bool = False
                    ) -> str:
    """The summary's line for a region that keeps the per-token plan (``holds_weight_sums``)."""
    ours, stock = weight_sums_peaks(rows, vocab, width, stock_fp32, row_local)
    return (f"the loss in the graph would hold FP32 [V, H] sums of {4 * vocab * width // MIB} MiB, a peak of "
            f"{ours // MIB} MiB above stock's {stock // MIB} MiB (T {rows}, V {vocab}, H {width}): "
            "vocabulary blocks over all rows instead (one GEMM more, no [V, H] sum)")


def backward_tiles(budget_bytes: int, n: int, vocab: int, width: int, fp32: bool) -> tuple[int, int]:
    """(columns per vocabulary block, rows per row tile) of a vocabulary-block sweep over
    ``n`` rows (within the budget, capped for small problems as the forward's); ``fp32``:
    the ``"fp32_tiles"`` plan (``backward_plan``), else ``"blocks"``.

    ``"blocks"``: a block holds all rows (one model-precision matmul per block writes
    ``grad_weight[block]``, FP32 accumulation inside it): about ``budget / (8 n)``
    columns.  ``"fp32_tiles"``: the matmuls run on FP32 copies, made per tile so that no
    FP32 copy of the whole ``hidden`` exists: blocks of ``budget / (16 H)`` columns with
    their own FP32 ``[cols, H]`` accumulator for ``grad_weight[block]`` (half the
    budget with the FP32 copy of the weight block), row tiles filling the other half
    (per element: bf16 logits, bf16 and FP32 gradient, FP32 matmul output; plus the
    FP32 copy of the ``hidden`` rows).
    """
    budget_bytes = _budget(budget_bytes, n, vocab)
    if not fp32:
        return aligned(budget_bytes // (8 * max(1, n))), max(1, n)
    cols = aligned(min(vocab, budget_bytes // (16 * width)))
    rows = aligned(min(n, (budget_bytes // 2) // (12 * cols + 4 * width)))
    return cols, rows


def gpu_block_cols(budget_bytes: int, n: int, vocab: int) -> int:
    """Columns per vocabulary block of the ``"gpu"`` plan's sweep over ``n`` rows: all
    rows in one tile (``grad_weight[block]`` is one GEMM whose sum over the rows, K = n,
    is inside it); the block's model-precision logits and gradient (4 bytes an element)
    fill the budget (capped for small problems as the forward's).  Even blocks: as few
    as the budget's columns allow, each ``V / blocks`` rounded *up* to the granule, so a
    block may hold up to one granule of columns (127) more than the budget's; rounding
    the budget's columns down first made one block more (at T 8192, V 151936: 37888
    columns, under V / 4 = 37984, so 5 blocks instead of 4)."""
    if n == 0:
        return max(1, vocab)
    most = max(1, min(vocab, _budget(budget_bytes, n, vocab) // (4 * n)))
    even = -(-vocab // -(-vocab // most))  # V over the fewest blocks of at most `most`, rounded up
    unit = granule(even)
    return min(vocab, -(-even // unit) * unit)


def sweep_sizes(budget_bytes: int, n: int, vocab: int) -> tuple[int, int]:
    """(rows per row chunk, columns per vocabulary block) of the ``two_sweeps`` backward:
    a chunk's or a block's model-precision logits and gradient (4 bytes an element) fill
    the budget (capped for small problems as the forward's)."""
    budget_bytes = _budget(budget_bytes, n, vocab)
    return aligned(budget_bytes // (4 * vocab)), aligned(budget_bytes // (4 * max(1, n)))


def accumulator_rows(budget_bytes: int, n: int, width: int) -> int:
    """Rows whose ``grad_hidden`` one backward sweep accumulates in FP32: an FP32
    ``[rows, H]`` buffer of at most half the budget, so never one of ``[T, H]``
    (all rows when ``4 T H`` bytes fit)."""
    rows = ((budget_bytes or CPU_BUDGET) // 2) // (4 * max(1, width))
    return n if rows >= n else aligned(rows)


# Working set of a row-local chunk per element of its widest row input: what a top-p region's
# compiled body keeps at once (a sort's FP32 values and int64 indices, the cumsum, the
# masks, the scattered mask: measured about 25 bytes), so a chunk stays within the budget.
BYTES_PER_ELEMENT = 32
# Working set of a row chunk or a vocabulary block of a row-local sweep per logit: the logits
# and their gradient in model precision and one FP32 temporary (a top-k's input), so that a
# chunk of W-sized logits holds 128 rows at the CPU's 32 MiB: a GEMM that runs near its peak
# (32-row GEMMs took 2.7x as long here).  (A row chunk writes its gradient over its logits,
# sweeps.stats_into, so holds 6 of the 8; a block's gradient is a tile of its own.)
SWEEP_BYTES_PER_ELEMENT = 8


def chunk_rows(rows: list, budget_bytes: int) -> int:
    """Rows (indices of dim 0) per row-local chunk: the budget (``BY_DEVICE``: the device's,
    ``device_budget``) over the widest row's working set, ``aligned``."""
    width = max((r[0].numel() if r.dim() and r.shape[0] else 1 for r in rows), default=1)
    return aligned(resolve_budget(budget_bytes, rows[0].device) // (BYTES_PER_ELEMENT * max(width, 1)))


def sweep_step(n: int, width: int, budget_bytes: int, device: torch.device) -> int:
    """Rows (or columns) per piece of a row-local sweep over ``n`` of them, each ``width``
    logits wide (``SWEEP_BYTES_PER_ELEMENT`` each)."""
    return max(1, min(n, resolve_budget(budget_bytes, device) // (SWEEP_BYTES_PER_ELEMENT * max(1, width))))


def product_cols(budget_bytes: int, vocab: int, width: int) -> int:
    """Columns per FP32 ``[cols, H]`` product of a gradient summed over row chunks
    (``grad_weight += g[:, cols].T @ h``): at most the budget (resolved by the caller)."""
    return max(1, min(vocab, budget_bytes // (4 * width)))


def spans(total: int, most: int) -> list[tuple[int, int]]:
    """:func:`even_splits`, with one empty span for no rows (a loop that runs once)."""
    return even_splits(total, most) or [(0, 0)]


def even_splits(total: int, most: int) -> list[tuple[int, int]]:
    """``[0, total)`` cut into the fewest pieces of at most ``most``: multiples of
    ``granule(most)`` but the last, as even as that allows (no 1-row remainder tile with
    its own 1-row kernel where the pieces can be even)."""
    most, unit = max(1, most), granule(max(1, most))
    if unit == 1 or total <= most:
        k = -(-total // most)
        q, extra = divmod(total, max(1, k))
        bounds, start = [], 0
        for i in range(k):
            end = start + q + (1 if i < extra else 0)
            bounds.append((start, end))
            start = end
        return bounds
    step = most // unit * unit
    k = -(-total // step)
    size = min(step, -(-(-(-total // k)) // unit) * unit)  # total / k rounded up to the unit
    return [(a, min(total, a + size)) for a in range(0, total, size)]


def _say_no_out_dtype(device_type: str) -> None:
    """(once per device type)"""
    say_once(logging.INFO, "chunked_logits: lm_head_plan 'gpu' needs aten::mm.dtype on %s, which this torch "
             "%s lacks: the backward runs 'blocks'", device_type, torch.__version__)


# NOTE [lm_head backward plans]
# Each gradient element is one sum (``grad_hidden[t]`` over the vocabulary,
# ``grad_weight[v]`` over the rows), accumulated in FP32 and rounded to the model dtype
# once, as stock's matmuls do.  A model-precision matmul rounds its own output, so a
# sum that spans several matmul calls must run on FP32 copies, unless each sum fits in
# one call:
#
# * ``"two_sweeps"`` (CPUs that multiply ``dtype`` in hardware, AVX-512 BF16 / AMX):
#   model-precision matmuls only, each holding a whole sum: row chunks over the whole
#   vocabulary write ``grad_hidden``, vocabulary blocks over all rows write
#   ``grad_weight``.  The logits are recomputed once in each sweep.
# * ``"fp32_tiles"`` (other CPUs): one sweep over vocabulary blocks x row tiles on FP32
#   copies of the model-precision operands (the same maths: exact products, FP32
#   accumulation, one rounding; the logits of a biased lm_head from the model-precision
#   operands, as the forward made them: NOTE [the logits the backward recomputes] in
#   ``log_softmax/lm_head_sweeps.py``), ``grad_hidden`` accumulated in FP32 for a bounded
#   group of rows at a time.  FP32 GEMM is the faster kernel there (a CPU without bf16
#   units runs a bf16 GEMM through conversions).
# * ``"gpu"`` (CUDA, XPU: where this torch has ``aten::mm.dtype`` for the device):
#   vocabulary blocks over all rows, model-precision inputs only: per block the logits
#   are recomputed, ``grad_weight[block]`` is one GEMM (its sum over the rows inside
#   it), and ``grad_hidden`` is accumulated across the blocks by GEMMs with an FP32
#   output (``out_dtype``) into an FP32 buffer for a bounded group of rows, rounded
#   once.  Four ``[T, H] x [H, V]`` GEMMs a step with the forward's, when the group
#   holds all rows (``kernels/log_softmax/gpu_plan.py``).
# * ``"blocks"`` (GPUs whose torch has no ``mm.dtype``): as ``"gpu"``, but the FP32
#   accumulation of ``grad_hidden`` runs on FP32 copies of the gradient and the
#   weight block (an FP32-input GEMM: several times slower on tensor-core GPUs).
# * ``"kept_logits"`` (a user's choice on any device; ``auto``'s on a GPU where stock
#   keeps an FP32 ``[T, V]``, below): a per-token call
#   that returns no logits keeps its model-precision logits from the forward, and the
#   backward writes their gradient in their place and runs stock's two GEMMs: three a
#   step, at stock's cross-entropy memory (NOTE [kept logits], ``log_softmax/lm_head_kept.py``);
#   a loss in the graph stays there, on that call.
#   The loops that keep no logits (masked rows, the loss in the graph, row-local,
#   vocab-parallel, no backward) run the device's ``"auto"`` plan.
#
# ``"auto"`` on a GPU keeps the logits (``keeps_logits``) where stock keeps the region's
# FP32 ``[T, V]`` (a log-prob's gather, an entropy: anything but a cross-entropy alone) and
# no row mask gives the loop rows to leave out: there the kept bf16 logits (``2 T V``) are
# a third of what stock holds, no FP32 ``[T, V]`` exists (what the hand fixes in RL
# trainers achieve), and the step runs stock's three GEMMs.  The cost model calibrated on
# the H200 run of 2026-12-04 (docs/gpu.md) puts it at 0.95x stock's step at T 8192, V
# 151936, H 4096, against 1.36x per token and 1.01x with the loss in the graph for the
# recomputing ``"gpu"`` loops (0.28x and 0.52x stock's peak, against kept's 0.51x).  A
# cross-entropy alone (stock keeps only its bf16 logits, which keeping would match) keeps
# the recomputing loops: there they are the memory saved.  ``lm_head_plan="gpu"`` forces
# the recomputing loops for a log-prob too.  A CPU's plans are unchanged (host memory,
# its own GEMM costs: docs/gemms.md).


def keeps_logits(device_type: str, stock_fp32: bool, plan: str = "auto") -> bool:
    """Does a per-token lm_head call that returns no logits keep them for its backward
    (``"kept_logits"``)?  ``stock_fp32``: stock keeps the region's FP32 ``[T, V]``; masked
    rows keep their own loops (the caller's).  See NOTE [lm_head backward plans]."""
    if plan == "kept_logits":
        return True
    return plan == "auto" and device_type != "cpu" and stock_fp32


def backward_plan(device: torch.device, dtype: torch.dtype, plan: str = "auto") -> str:
    """The lm_head backward's plan for ``device`` and ``dtype``: one of ``config.LM_HEAD_PLANS``
    but "auto" (``plan`` forces one).  Every plan rounds each gradient element once, from
    one FP32 sum.  "gpu" where the device lacks ``mm.dtype`` runs "blocks" (logged);
    "kept_logits" is "auto" here (the loops that keep no logits); choosing "gpu" runs the
    device's one-time ``addmm`` probe (``compat.probe_addmm_into``).
    See NOTE [lm_head backward plans].
    """
    if plan == "gpu" and not compat.gemm_out_dtype(device.type):
        _say_no_out_dtype(device.type)
        return "blocks"
    if plan == "kept_logits":  # (where no logits are kept: NOTE [kept logits])
        plan = "auto"
    if plan == "auto" and device.type != "cpu":
        plan = "gpu" if compat.gemm_out_dtype(device.type) else "blocks"
    if plan == "auto":
        return "two_sweeps" if compat.cpu_matmul_in_hardware(dtype) else "fp32_tiles"
    if plan == "gpu":  # (the fake kernels and the rewrites call this at compile time: no probe in a step)
        compat.probe_addmm_into(device, dtype)
    return plan
