"""Read Inductor's generated code: which FP32 buffers does it allocate?

This is how the tests assert memory deterministically: a rewritten region must
not allocate any FP32 buffer of full ``[T, V]`` size, forward or backward.
"""

from __future__ import annotations

import math
import re

import torch
from torch._inductor.utils import run_and_get_code

_ALLOC = re.compile(
    r"empty_strided(?:_\w+)?\(\(([^()]*)\),\s*\(([^()]*)\),\s*(?:device=[^,]+,\s*)?(?:dtype=)?(torch\.\w+)")


def allocations(code: str) -> list[tuple[tuple[str, ...], str]]:
    """Every ``empty_strided*`` allocation: (sizes as text, dtype)."""
    out = []
    for sizes, _, dtype in _ALLOC.findall(code):
        dims = tuple(d.strip() for d in sizes.split(",") if d.strip())
        out.append((dims, dtype))
    return out


def full_fp32_buffers(codes: list[str], rows: int, vocab: int) -> list[tuple[str, ...]]:
    """FP32 buffers of at least rows*vocab elements (static sizes), or with two or
    more symbolic/non-unit dims (dynamic sizes, where a [T, V] buffer looks like (s0, s1))."""
    flagged = []
    for code in codes:
        for dims, dtype in allocations(code):
            if dtype != "torch.float32":
                continue
            if all(d.isdigit() for d in dims):
                if math.prod(int(d) for d in dims) >= rows * vocab:
                    flagged.append(dims)
            elif sum(1 for d in dims if d != "1") >= 2:
                flagged.append(dims)
    return flagged


def compiled_codes(fn, *args, **kwargs) -> tuple[object, list[str]]:
    """Run ``fn`` once, returning its result and all code Inductor generated for it."""
    return run_and_get_code(fn, *args, **kwargs)


def step_codes(workload, compiled, inputs) -> list[str]:
    from benchmarks.workloads import run_step
    _, codes = run_and_get_code(run_step, workload, compiled, inputs)
    return codes


__all__ = ["allocations", "full_fp32_buffers", "compiled_codes", "step_codes", "torch"]
