"""Boolean per-row masks packed eight to a byte, for a row-local region's forward to save
and its backward to read (:mod:`fx_passes.rewrite.saved`).

Both functions are plain tensor maths that the region bodies call, so Inductor compiles
them into the body's own kernels: the forward writes ``V / 8`` bytes a row, the backward
reads them, and neither makes a ``[rows, V]`` boolean buffer of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.registry import emitted

__all__ = ["pack_bits", "unpack_bits", "packed_bytes"]


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(8, dtype=torch.uint8, device=device)


def packed_bytes(elements_per_row: int) -> int:
    """Bytes a row of ``elements_per_row`` flags takes packed."""
    return -(-elements_per_row // 8)


@emitted()
def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` ``[rows, ..]`` (bool) as ``[rows, ceil(numel per row / 8)]`` uint8: flag
    ``j`` of a row is bit ``j % 8`` of byte ``j // 8``."""
    flat = mask.flatten(1).to(torch.uint8)  # (not reshape(rows, -1): a chunk may have no rows)
    pad = (-flat.shape[1]) % 8
    if pad:
        flat = F.pad(flat, (0, pad))
    bits = flat.unflatten(1, (-1, 8))
    # eight pointwise ORs, not a sum over the last dim: Inductor's CPU code for a uint8
    # reduction of 8 runs ~80x slower than this one vectorised pass
    out = bits[..., 0]
    for i in range(1, 8):
        out = out | (bits[..., i] << i)
    return out


@emitted()
def unpack_bits(packed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The mask :func:`pack_bits` packed, in the shape of ``like`` (a tensor of the
    mask's shape: the region's row input it was found to match)."""
    bits = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
    per_row = like.shape[1:].numel()
    return bits.flatten(1)[:, :per_row].reshape(like.shape).to(torch.bool)
