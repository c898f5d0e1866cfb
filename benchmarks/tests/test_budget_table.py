"""The cost model at the chunk budgets (issue 35, item 3; docs/gpu.md, "Chunk budget")."""

from __future__ import annotations

from fx_passes.kernels import tiling

MIB, GIB = 2**20, 2**30


def _ratios(budget):
    from benchmarks import cost_loops as loops
    from benchmarks import cost_roofline as roof

    dev = roof.DEVICES[-1]  # H200
    T, H, V = 16384, 4096, 151936
    stock = roof.step_time(loops.stock(T, H, V, "ce"), dev)
    default = budget == tiling.device_budget("cuda", 140 * GIB)
    build = loops.Build(by_device=default)
    return tuple(roof.step_time(loops.ours(T, H, V, "gpu", gif, budget, build), dev) / stock
                 for gif in (True, False))


def test_cost_model_targets_at_the_default_and_at_256_mib():
    """H200, H 4096, V 151936, T 16384 (the 'gpu' plan), the model calibrated on the H200
    run (issue 54): at the device's default budget loss-in-graph <= 1.08x stock and
    per-token <= 1.45x; at a user-set 256 MiB <= 1.8x / 2.1x (docs/gpu.md, "Chunk budget":
    ``python benchmarks/cost_model.py --budgets``; the uncalibrated model said 1.02x /
    1.32x, the H200 measured 1.05-1.11x for the loss in the graph)."""
    gif, per_token = _ratios(tiling.device_budget("cuda", 140 * GIB))
    assert gif <= 1.08 and per_token <= 1.45, (gif, per_token)
    gif, per_token = _ratios(256 * MIB)
    assert gif <= 1.8 and per_token <= 2.1, (gif, per_token)
