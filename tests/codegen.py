"""Get the code Inductor generates for a step, to read its allocations with
``fx_passes.testing.codegen`` (re-exported here for the tests)."""

from __future__ import annotations

import re

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


def inputs_of_rank(code: str, rank: int) -> list[str]:
    """The names of the compiled graph's inputs of ``rank`` dimensions, from the size
    asserts of its wrapper: ``assert_size_stride(name, (s0, s1), ...)`` one by one (torch
    <= 2.13) or ``assert_size_stride_grouped((name, ...), ((s0, s1), ...), ...)`` (2.14)."""
    names = [(m[1], m[2]) for m in re.finditer(r"assert_size_stride\((\w+), \(([^()]*)\)", code)]
    for m in re.finditer(r"assert_size_stride_grouped\(\(([^()]*)\), \(((?:\([^()]*\),? ?)*)\)", code):
        names += zip((n.strip() for n in m[1].split(",") if n.strip()), re.findall(r"\(([^()]*)\)", m[2]))
    return [n for n, sizes in names if len([d for d in sizes.split(",") if d.strip()]) == rank]


__all__ = ["allocations", "full_fp32_buffers", "compiled_codes", "step_codes", "inputs_of_rank", "torch"]
