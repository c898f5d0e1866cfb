"""How the lm_head loop cuts its work: rows per forward chunk, vocabulary blocks and
row tiles of the backward, rows per FP32 ``grad_hidden`` accumulator.

Every size comes from one working-set budget (``Config.chunk_budget_mib``), so the
memory the loop needs above the model-precision gradients is bounded by the budget,
whatever T and V are.
"""

from __future__ import annotations

import torch

from .. import compat

__all__ = ["forward_rows", "backward_tiles", "sweep_sizes", "accumulator_rows", "even_splits",
           "backward_plan"]


def _budget(budget_bytes: int, n: int, vocab: int) -> int:
    """The configured working set, but never more than a quarter of the FP32 logits:
    a small problem gets several chunks too, instead of one chunk bigger than stock."""
    return max(1, min(budget_bytes, n * vocab))


def forward_rows(budget_bytes: int, n: int, vocab: int) -> int:
    """Rows per forward chunk: one FP32 ``[rows, V]`` chunk fills the budget."""
    return max(1, _budget(budget_bytes, n, vocab) // (4 * vocab))


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
        return max(1, budget_bytes // (8 * max(1, n))), max(1, n)
    cols = max(1, min(vocab, budget_bytes // (16 * width)))
    rows = max(1, min(n, (budget_bytes // 2) // (12 * cols + 4 * width)))
    return cols, rows


def sweep_sizes(budget_bytes: int, n: int, vocab: int) -> tuple[int, int]:
    """(rows per row chunk, columns per vocabulary block) of the ``two_sweeps`` backward:
    a chunk's or a block's model-precision logits and gradient (4 bytes an element) fill
    the budget (capped for small problems as the forward's)."""
    budget_bytes = _budget(budget_bytes, n, vocab)
    return max(1, budget_bytes // (4 * vocab)), max(1, budget_bytes // (4 * max(1, n)))


def accumulator_rows(budget_bytes: int, n: int, width: int) -> int:
    """Rows whose ``grad_hidden`` one backward sweep accumulates in FP32: an FP32
    ``[rows, H]`` buffer of at most half the budget, so never one of ``[T, H]``
    (all rows when ``4 T H`` bytes fit)."""
    return max(1, min(n, (budget_bytes // 2) // (4 * max(1, width))))


def even_splits(total: int, most: int) -> list[tuple[int, int]]:
    """``[0, total)`` cut into the fewest pieces of at most ``most``, their sizes
    differing by at most one (no 1-row remainder tile with its own 1-row kernel)."""
    k = -(-total // max(1, most))
    q, extra = divmod(total, max(1, k))
    bounds, start = [], 0
    for i in range(k):
        end = start + q + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def backward_plan(device: torch.device, dtype: torch.dtype, plan: str = "auto") -> str:
    """How the lm_head backward computes ``grad_hidden`` and ``grad_weight``.

    Each gradient element is one sum (``grad_hidden[t]`` over the vocabulary,
    ``grad_weight[v]`` over the rows), accumulated in FP32 and rounded to the model dtype
    once, as stock's matmuls do.  A model-precision matmul rounds its own output, so a
    sum that spans several matmul calls must run on FP32 copies, unless each sum fits in
    one call:

    * ``"two_sweeps"`` (CPUs that multiply ``dtype`` in hardware, AVX-512 BF16 / AMX):
      model-precision matmuls only, each holding a whole sum: row chunks over the whole
      vocabulary write ``grad_hidden``, vocabulary blocks over all rows write
      ``grad_weight``.  The logits are recomputed once in each sweep.
    * ``"fp32_tiles"`` (other CPUs): one sweep over vocabulary blocks x row tiles on FP32
      copies of the model-precision operands (the same maths: exact products, FP32
      accumulation, one rounding), ``grad_hidden`` accumulated in FP32 for a bounded
      group of rows at a time.  FP32 GEMM is the faster kernel there (measured: the
      backward of W4 about 1.5x faster; a bf16 GEMM of W4's size about 6x slower than
      FP32 with AVX2 only).
    * ``"blocks"`` (GPUs): vocabulary blocks over all rows, ``grad_weight[block]`` in one
      model-precision matmul, ``grad_hidden`` accumulated in FP32 per group of rows.
    """
    if plan != "auto":
        return plan
    if device.type != "cpu":
        return "blocks"
    return "two_sweeps" if compat.cpu_matmul_in_hardware(dtype) else "fp32_tiles"
