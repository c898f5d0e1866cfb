"""How the lm_head loop cuts its work: rows per forward chunk, vocabulary blocks and
row tiles of the backward, rows per FP32 ``grad_hidden`` accumulator.

Every size comes from one working-set budget (``Config.chunk_budget_mib``), so the
memory the loop needs above the model-precision gradients is bounded by the budget,
whatever T and V are.
"""

from __future__ import annotations

import torch

__all__ = ["forward_rows", "backward_tiles", "accumulator_rows", "even_splits", "fp32_gemm"]


def _budget(budget_bytes: int, n: int, vocab: int) -> int:
    """The configured working set, but never more than a quarter of the FP32 logits:
    a small problem gets several chunks too, instead of one chunk bigger than stock."""
    return max(1, min(budget_bytes, n * vocab))


def forward_rows(budget_bytes: int, n: int, vocab: int) -> int:
    """Rows per forward chunk: one FP32 ``[rows, V]`` chunk fills the budget."""
    return max(1, _budget(budget_bytes, n, vocab) // (4 * vocab))


def backward_tiles(budget: int, n: int, vocab: int, width: int,
                   device: torch.device) -> tuple[int, int, bool]:
    """(columns per vocabulary block, rows per row tile, FP32 GEMMs?) of a backward
    sweep over ``n`` rows (within the budget, capped for small problems as the forward's).

    On GPUs a block holds all rows (one model-precision matmul per block writes
    ``grad_weight[block]``, FP32 accumulation inside it): about ``budget / (8 n)``
    columns.  On CPUs the matmuls run on FP32 copies, made per tile so that no FP32
    copy of the whole ``hidden`` exists: blocks of ``budget / (16 H)`` columns with
    their own FP32 ``[cols, H]`` accumulator for ``grad_weight[block]`` (half the
    budget with the FP32 copy of the weight block), row tiles filling the other half
    (per element: bf16 logits, bf16 and FP32 gradient, FP32 matmul output; plus the
    FP32 copy of the ``hidden`` rows).
    """
    budget = _budget(budget, n, vocab)
    if not fp32_gemm(device):
        return max(1, budget // (8 * max(1, n))), max(1, n), False
    cols = max(1, min(vocab, budget // (16 * width)))
    rows = max(1, min(n, (budget // 2) // (12 * cols + 4 * width)))
    return cols, rows, True


def accumulator_rows(budget: int, n: int, width: int) -> int:
    """Rows whose ``grad_hidden`` one backward sweep accumulates in FP32: an FP32
    ``[rows, H]`` buffer of at most half the budget, so never one of ``[T, H]``
    (all rows when ``4 T H`` bytes fit)."""
    return max(1, min(n, (budget // 2) // (4 * max(1, width))))


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


def fp32_gemm(device: torch.device) -> bool:
    """Run the backward's matmuls on FP32 copies of the bf16/fp16 operands?

    The result is the same maths as a model-precision matmul (exact products of the
    model-precision values, FP32 accumulation, one rounding).  On CPUs without native
    bf16 matmul units FP32 GEMM is the faster kernel (measured: the backward of W4 about
    1.5x faster; a bf16 GEMM of W4's size about 6x slower than FP32 with AVX2 only).  On
    CPUs with them (AVX-512 BF16, AMX) it is the slower one, and the step is slower than
    stock Inductor's (README, known limits): a bf16 path for those CPUs is not built
    yet.  GPUs keep their bf16/fp16 tensor-core matmuls.
    """
    return device.type == "cpu"
