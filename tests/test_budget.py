"""The chunk budget and the sizes cut from it (issue 35, item 3): a pure function of the
problem (rows, V, H), the device kind and its total memory, and the Config, so every
step and every rank cuts the same chunks; pieces are multiples of 128 rows / columns but
the last (of 8 where a piece holds 64 to 1023); the vocab-parallel loops take the same
budget (benchmarks/tests/test_budget_table.py: the cost model's targets)."""

from __future__ import annotations

import itertools

import pytest
import torch

from fx_passes import Config
from fx_passes.kernels import tiling

MIB, GIB = 2**20, 2**30
ALIGN = 128


# ---- the budget -------------------------------------------------------------------------------

def test_default_budget_per_device_kind():
    """32 MiB on a CPU; a GPU's 1/64 of its total memory within 256 MiB and 2 GiB."""
    assert tiling.device_budget("cpu", None) == tiling.device_budget("cpu", 10**12) == 32 * MIB
    assert tiling.device_budget("cuda", None) == 256 * MIB  # total memory unknown
    assert tiling.device_budget("cuda", 140 * GIB) == tiling.device_budget("xpu", 140 * GIB) == 2 * GIB
    assert tiling.device_budget("cuda", 79 * GIB) == 1264 * MIB  # an H100 (80 GB)
    assert tiling.device_budget("cuda", 24 * GIB) == 384 * MIB
    assert tiling.device_budget("cuda", 8 * GIB) == 256 * MIB
    cpu = torch.device("cpu")
    assert tiling.resolve_budget(tiling.BY_DEVICE, cpu) == 32 * MIB
    assert tiling.resolve_budget(MIB, cpu) == MIB  # an explicit chunk_budget_mib
    assert Config(chunk_budget_mib=256).device_budget_bytes == 256 * MIB


class _FakeCuda:
    """``torch.cuda`` as a training process's would answer: free memory that moves
    between calls (the caching allocator, a colocated rollout engine), total fixed."""

    def __init__(self):
        self.free_calls = 0

    def mem_get_info(self, device=None):
        self.free_calls += 1
        return (self.free_calls * 512 * MIB, 140 * GIB)

    def get_device_properties(self, index):
        return type("Props", (), {"total_memory": 140 * GIB})()


def test_budget_is_independent_of_free_memory(monkeypatch):
    """The device's budget reads its total memory, never the free memory at the call:
    the same on every call however the free memory moves."""
    from fx_passes import compat

    fake = _FakeCuda()
    for name in ("mem_get_info", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    if hasattr(compat, "_total_bytes"):
        compat._total_bytes.cache_clear()
    try:
        got = {tiling.resolve_budget(tiling.BY_DEVICE, torch.device("cuda", 0)) for _ in range(5)}
    finally:
        if hasattr(compat, "_total_bytes"):
            compat._total_bytes.cache_clear()
    assert got == {tiling.device_budget("cuda", 140 * GIB)} and fake.free_calls == 0, (got, fake.free_calls)


# ---- the sizes over a grid --------------------------------------------------------------------

TOTALS = [None, 8 * GIB, 24 * GIB, 79 * GIB, 140 * GIB]
SHAPES = list(itertools.product([1, 100, 128, 1000, 4096, 16384, 65536], [18992, 32768, 50257, 151936],
                                [1024, 4096, 8192]))


def _check_pieces(pieces, total, most):
    """Contiguous cover of [0, total); each piece at most ``most``; all but the last a
    multiple of 128 when ``most`` holds 1024 (of 8 when it holds 64), and no more pieces
    than aligned ones need."""
    assert pieces == tiling.even_splits(total, most)  # (deterministic)
    if total == 0:
        assert pieces == []
        return
    assert pieces[0][0] == 0 and pieces[-1][1] == total
    assert all(a < b for a, b in pieces) and all(b == c for (_, b), (c, _) in zip(pieces, pieces[1:]))
    assert all(b - a <= max(1, most) for a, b in pieces), (total, most, pieces[:3])
    unit = ALIGN if most >= 8 * ALIGN else 8 if most >= 64 else 1
    if unit > 1:
        assert all((b - a) % unit == 0 for a, b in pieces[:-1]), (total, most, pieces[:3])
        assert len(pieces) == (1 if total <= most else -(-total // (most // unit * unit)))
    else:
        assert len(pieces) == -(-total // max(1, most))


@pytest.mark.sampled
@pytest.mark.parametrize("total_bytes", TOTALS, ids=lambda t: f"{(t or 0) // GIB}GiB")
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_sizes_over_a_grid(device_type, total_bytes):
    budget = tiling.device_budget(device_type, total_bytes)
    assert budget == tiling.device_budget(device_type, total_bytes)  # a pure function
    assert budget % MIB == 0 and 32 * MIB <= budget <= 2 * GIB
    for budget in (budget, 256 * MIB, 32 * MIB):
        for t, v, h in SHAPES:
            rows = tiling.forward_rows(budget, t, v)
            assert rows >= 1 and rows % (ALIGN if rows >= 8 * ALIGN else 8 if rows >= 64 else 1) == 0
            assert rows * 4 * v <= max(budget, 4 * v * min(rows, ALIGN)), (t, v, rows)  # within the budget
            _check_pieces(tiling.even_splits(t, rows), t, rows)
            cols = tiling.gpu_block_cols(budget, t, v)
            unit = ALIGN if cols >= 8 * ALIGN else 8 if cols >= 64 else 1
            assert cols % unit == 0 or cols == v
            # (even blocks: each rounded up to the granule, at most one granule over the budget)
            assert (cols - unit + 1) * t * 4 <= max(budget, 4 * t * min(cols, ALIGN))
            assert len(tiling.even_splits(v, cols)) == -(-v // max(1, min(v, min(budget, t * v) // (4 * t))))
            _check_pieces(tiling.even_splits(v, cols), v, cols)
            sweep_rows, sweep_cols = tiling.sweep_sizes(budget, t, v)
            _check_pieces(tiling.even_splits(t, sweep_rows), t, sweep_rows)
            _check_pieces(tiling.even_splits(v, sweep_cols), v, sweep_cols)
            for fp32 in (False, True):
                bc, br = tiling.backward_tiles(budget, t, v, h, fp32)
                _check_pieces(tiling.even_splits(v, bc), v, bc)
                _check_pieces(tiling.even_splits(t, br), t, br)
            acc = tiling.accumulator_rows(budget, t, h)
            assert acc * 4 * h <= max(budget // 2, 4 * h * min(acc, ALIGN))
            _check_pieces(tiling.even_splits(t, acc), t, acc)


def test_vocab_blocks_are_aligned_at_v_151936():
    """Issue 35's example: blocks of 30387 / 30388 columns before; now multiples of 128
    (grad_weight's column slices start at multiples of 128) but the last."""
    pieces = tiling.even_splits(151936, 30388)
    assert [b - a for a, b in pieces] == [25344] * 5 + [25216]  # (6 pieces, as 30388 columns need)
    assert all(a % ALIGN == 0 for a, _ in pieces)


# ---- the vocab-parallel loops ------------------------------------------------------------------

def test_vocab_parallel_rewrite_takes_the_devices_budget():
    """The vocab-parallel calls carry ``BY_DEVICE`` (resolved where they run, by the
    same rule as the lm_head loop's) unless ``chunk_budget_mib`` is set."""
    import inspect

    from fx_passes.distributed import shard_stages
    assert "config.device_budget_bytes" in inspect.getsource(shard_stages.rewrite_shard_region)


# ---- the row-local loop on given logits ---------------------------------------------------------

@pytest.mark.parametrize("budget", [tiling.BY_DEVICE, 256 * MIB, 32 * MIB, MIB])
def test_row_local_chunks_are_aligned(budget):
    """The given-logits row-local loop (``kernels/row_local/engine.py``) cuts its rows by the
    same rule as the lm_head loop: ``tiling.aligned`` rows per chunk, ``tiling.even_splits``
    offsets (before: 1048-row chunks at V 1000 with the CPU's 32 MiB, offsets off the
    128-row grid; now 1024)."""
    for t, v in itertools.product([1, 63, 100, 1000, 4096, 16384], [1000, 18992, 151936]):
        rows = [torch.empty(t, v, dtype=torch.bfloat16, device="meta")]
        width = tiling.chunk_rows(rows, budget)
        raw = tiling.resolve_budget(budget, rows[0].device) // (tiling.BYTES_PER_ELEMENT * v)
        assert width == tiling.aligned(raw) and width <= max(1, raw), (t, v, width, raw)
        pieces = tiling.spans(t, width)
        _check_pieces(pieces, t, width)
