"""Row-local regions at run time: the user's own ops, chunk by chunk of rows.

A row-local region (:mod:`fx_passes.match.row_local`) is an FX graph
``fn(*rows, *whole) -> tuple`` of per-row results, registered in
:data:`~fx_passes.kernels.registry.GRAPH_BODIES`.  :func:`row_local` runs it on slices of
``rows`` (the model-precision logits and the per-row tensors, sliced along dim 0) with
``whole`` (broadcast operands) passed to every chunk, and concatenates the per-row
results.  Inductor compiles the body once (``dynamic=True``: every chunk size, the last
one included, runs the same kernels), so the FP32 ``[.., V]`` values of a chunk exist
only as that chunk's temporaries: a sort, a cumsum, a top-k mask of ``rows_per_chunk``
rows, or nothing at all where Inductor fuses the chunk's ops into its reductions.

The backward recomputes each chunk and takes the vector-Jacobian product of the same
ops (compiled once per key and set of inputs needing a gradient), writing each row
input's gradient in its own dtype: one rounding of the FP32 gradient, as stock
autograd's cast backward does.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import graph_bodies

__all__ = ["row_local", "BYTES_PER_ELEMENT", "chunk_rows"]

# Working set of a chunk per element of its widest row input: what a top-p region's
# compiled body keeps at once (a sort's FP32 values and int64 indices, the cumsum, the
# masks, the scattered mask: measured about 25 bytes), so a chunk stays within the budget.
BYTES_PER_ELEMENT = 32
COUNTER = "row_local_body_eager"


def chunk_rows(rows: list[torch.Tensor], budget_bytes: int) -> int:
    """Rows (indices of dim 0) per chunk: the budget over the widest row's working set."""
    width = max((r[0].numel() if r.dim() and r.shape[0] else 1 for r in rows), default=1)
    return max(1, budget_bytes // (BYTES_PER_ELEMENT * max(width, 1)))


def _spans(n: int, step: int) -> list[tuple[int, int]]:
    return [(i, min(i + step, n)) for i in range(0, n, step)] or [(0, 0)]


def _outputs(key: str, rows, whole) -> list[torch.Tensor]:
    return list(graph_bodies.function(key)(*rows, *whole))


@torch.library.custom_op("chunked_logits::row_local", mutates_args=())
def _row_local(key: str, rows: list[torch.Tensor], whole: list[torch.Tensor],
               budget_bytes: int) -> list[torch.Tensor]:
    body = graph_bodies.body(key, COUNTER)
    step = chunk_rows(rows, budget_bytes)
    parts = [body(*(r[a:b] for r in rows), *whole) for a, b in _spans(rows[0].shape[0], step)]
    return [torch.cat(list(p)) for p in zip(*parts)]


@_row_local.register_fake
def _(key, rows, whole, budget_bytes):
    return [torch.empty(o.shape, dtype=o.dtype, device=o.device) for o in _outputs(key, rows, whole)]


@torch.library.custom_op("chunked_logits::row_local_backward", mutates_args=())
def _row_local_backward(key: str, wanted: list[int], outputs: list[int], rows: list[torch.Tensor],
                        whole: list[torch.Tensor], grads: list[torch.Tensor],
                        budget_bytes: int) -> list[torch.Tensor]:
    vjp = graph_bodies.backward_body(key, tuple(wanted), tuple(outputs), COUNTER)
    step = chunk_rows(rows, budget_bytes)
    out = [torch.empty_like(rows[i], memory_format=torch.contiguous_format) for i in wanted]
    for a, b in _spans(rows[0].shape[0], step):  # each chunk's gradient written in place, then freed
        for o, g in zip(out, vjp(*(r[a:b] for r in rows), *whole, *(g[a:b] for g in grads))):
            o[a:b] = g
    return out


@_row_local_backward.register_fake
def _(key, wanted, outputs, rows, whole, grads, budget_bytes):
    return [torch.empty_like(rows[i], memory_format=torch.contiguous_format) for i in wanted]


def _setup(ctx, inputs, output):
    key, rows, whole, budget_bytes = inputs
    ctx.key, ctx.budget_bytes, ctx.n_rows = key, budget_bytes, len(rows)
    ctx.wanted = [i for i, r in enumerate(rows) if r.requires_grad]
    ctx.outputs = [i for i, o in enumerate(output) if o.is_floating_point()]
    ctx.shapes = [(output[i].shape, output[i].dtype) for i in ctx.outputs]
    ctx.save_for_backward(*rows, *whole)


def _backward(ctx, grads):
    saved = ctx.saved_tensors
    rows, whole = list(saved[:ctx.n_rows]), list(saved[ctx.n_rows:])
    picked = [grads[i] for i in ctx.outputs]
    picked = [g if g is not None else torch.zeros(shape, dtype=dtype, device=rows[0].device)
              for g, (shape, dtype) in zip(picked, ctx.shapes)]
    result: list[Optional[torch.Tensor]] = [None] * len(rows)
    if ctx.wanted and ctx.outputs:
        got = _row_local_backward(ctx.key, ctx.wanted, ctx.outputs, rows, whole, picked, ctx.budget_bytes)
        for i, g in zip(ctx.wanted, got):
            result[i] = g
    return None, result, [None] * len(whole), None


_row_local.register_autograd(_backward, setup_context=_setup)


def row_local(key: str, budget_bytes: int, n_rows: int, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The per-row results of the row-local region registered under ``key``: ``inputs``
    are its ``n_rows`` row inputs (sliced along dim 0), then its whole inputs."""
    return tuple(_row_local(key, list(inputs[:n_rows]), list(inputs[n_rows:]), budget_bytes))
