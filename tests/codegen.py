"""Get the code Inductor generates for a step, to read its allocations with
``benchmarks.codegen`` (re-exported here for the tests)."""

from __future__ import annotations

import torch
from torch._inductor.utils import run_and_get_code

from benchmarks.codegen import allocations, full_fp32_buffers


def compiled_codes(fn, *args, **kwargs) -> tuple[object, list[str]]:
    """Run ``fn`` once, returning its result and all code Inductor generated for it."""
    return run_and_get_code(fn, *args, **kwargs)


def step_codes(workload, compiled, inputs) -> list[str]:
    from benchmarks.workloads import run_step
    _, codes = run_and_get_code(run_step, workload, compiled, inputs)
    return codes


__all__ = ["allocations", "full_fp32_buffers", "compiled_codes", "step_codes", "torch"]
