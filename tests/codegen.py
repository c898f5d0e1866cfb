"""Get the code Inductor generates for a step, to read its allocations with
``fx_passes.testing.codegen`` (re-exported here for the tests)."""

from __future__ import annotations

import torch
from torch._inductor.utils import run_and_get_code

from fx_passes.testing.codegen import allocations, full_fp32_buffers
from fx_passes.testing.workloads import run_step


def compiled_codes(fn, *args, **kwargs) -> tuple[object, list[str]]:
    """Run ``fn`` once, returning its result and all code Inductor generated for it."""
    return run_and_get_code(fn, *args, **kwargs)


def step_codes(workload, compiled, inputs) -> list[str]:
    _, codes = run_and_get_code(run_step, workload, compiled, inputs)
    return codes


__all__ = ["allocations", "full_fp32_buffers", "compiled_codes", "step_codes", "torch"]
