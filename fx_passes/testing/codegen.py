"""Read Inductor's generated code: which FP32 buffers does it allocate?

This is how memory is asserted deterministically (tests) and checked on a GPU
(gpu_check): a rewritten region must not allocate any FP32 buffer of full ``[T, V]``
size, forward or backward.  C++ and Triton wrappers both allocate with
``empty_strided*``.
"""

from __future__ import annotations

import math
import re

__all__ = ["allocations", "full_fp32_buffers"]

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
