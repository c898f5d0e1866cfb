"""The "gpu" plan of a row-local loss with its gradients in the forward, for an incoming
gradient ``g``: its gradients (the unit loss's logits gradient rounded to bf16, FP32-output
GEMMs, times ``g`` in FP32, rounded once) against stock's (``g`` times the logits
gradient rounded to bf16, GEMMs), each against FP64, over seeds.  Prints, per loss, ``g``
and gradient, our mean error over stock's (mean, min, max over the seeds) and how many
seeds ours is the larger.  Run on the test-only CPU kernels of ``mm(..., out_dtype=)``:

    PYTHONPATH=$PWD .venv/bin/python -m tests.gradient_scaling --seeds 16
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch._dynamo.utils import counters

from fx_passes.testing.gemms import cpu_out_dtype_kernels
from tests import row_local_cases as rl
from tests import sweep_cases as sweeps
from tests.helpers import chunked_counters
from tests.numerics import F32, mean_err

T, V, H = sweeps.T, sweeps.V, sweeps.H
NAMES = ["forward_kl", "kl_div_linear", "smoothed_ce"]


def case(name: str, seed: int):
    """``sweeps.case``'s inputs, drawn from ``seed``."""
    hidden, weight = sweeps.head(seed=seed)
    teacher = rl.distinct_logits(T, V, torch.bfloat16, seed=1000 + seed)
    g = torch.Generator().manual_seed(2000 + seed)
    if name == "kl_div_linear":
        bias = (torch.randn(V, generator=g) / 4).to(torch.bfloat16)
        return (hidden.view(4, T // 4, H), weight, bias, teacher.view(4, T // 4, V)), (0, 1, 2)
    if name == "smoothed_ce":
        labels = rl.kept_tokens(hidden @ weight.T)
        labels[::7] = -100
        return (hidden, weight, labels, torch.rand(V, generator=g) + 0.5), (0, 1)
    return (hidden, weight, teacher), (0, 1)


def grads(fn, inputs, pos, scale: float, up=F32):
    inputs = [t.detach().clone().requires_grad_(i in pos) for i, t in enumerate(inputs)]
    out = fn(*inputs, up=up) if up is not F32 else fn(*inputs)
    return torch.autograd.grad(out, [inputs[i] for i in pos], torch.tensor(scale, dtype=out.dtype))


def ratios(name: str, seeds: int, scales: list[float]) -> dict:
    """(g, gradient index) -> our mean error over stock's, one a seed."""
    fn = sweeps.SPLIT[name]
    stock = torch.compile(fn, backend="inductor")
    ours = torch.compile(fn, backend="chunked_logits", options={"lm_head_plan": "gpu"})
    got: dict = {}
    counters.clear()
    with cpu_out_dtype_kernels():
        for seed in range(seeds):
            inputs, pos = case(name, seed)
            f64 = [t.double() if t.is_floating_point() else t for t in inputs]
            for s in scales:
                ref = grads(fn, f64, pos, s, up=torch.float64)
                pairs = zip(grads(ours, inputs, pos, s), grads(stock, inputs, pos, s), ref)
                for k, (a, b, r) in enumerate(pairs):
                    got.setdefault((s, k), []).append(mean_err(a, r) / mean_err(b, r))
    assert chunked_counters().get("gradients_in_forward") == 1, chunked_counters()
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=16)
    p.add_argument("--losses", default=",".join(NAMES))
    p.add_argument("--scales", default="0.3,-0.3,3,0.3333333333333333,5,0.45,-1")
    a = p.parse_args()
    scales = [float(s) for s in a.scales.split(",")]
    print("| loss | g | gradient | mean ratio | min | max | seeds ours > stock |")
    print("|---|---|---|---|---|---|---|")
    for name in a.losses.split(","):
        for (s, k), rs in ratios(name, a.seeds, scales).items():
            print(f"| {name} | {s:.4g} | {('hidden', 'weight', 'bias')[k]} | {statistics.mean(rs):.3f} | "
                  f"{min(rs):.3f} | {max(rs):.3f} | {sum(r > 1 for r in rs)}/{len(rs)} |", flush=True)


if __name__ == "__main__":
    main()
