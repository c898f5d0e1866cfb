"""gemm_floor.py's plumbing at a tiny size: every order's row, the reorder line, and the
FP32 sums' check (oneDNN's bf16 mode sums in FP32: an error of an FP32 sum, not a bf16
rounding's).  No timer assertions."""

from __future__ import annotations

from benchmarks import gemm_floor


def test_the_table_has_every_order(capsys):
    gemm_floor.main(["--workload", "WD", "--scale", "64", "--rounds", "1", "--threads", "1"])
    out = capsys.readouterr().out
    for order in ("| stock |", "| chunked (4) |", "| fp32 sums (3) |", "| stock, fp32 operands |",
                  "reordered every chunk"):
        assert order in out, out
    assert "1.00x; 1.00x" in out  # (stock against itself)


def test_the_fp32_sums_are_fp32_sums():
    import torch

    made = gemm_floor.families(64, 32, 256, 1 << 20)
    g, h, _ = made["check"]
    assert gemm_floor.fp32_sums_error(g, h) < 1e-5  # (a bf16 result: about 4e-3)
    assert not torch.backends.mkldnn.matmul.fp32_precision == "bf16"  # (restored)
