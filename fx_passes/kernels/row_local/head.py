"""A row-local region whose logits an lm_head matmul makes: the call runs the matmul whole
and writes the logits' gradient over them.

When nothing but the region reads the matmul's result
(:func:`fx_passes.rewrite.row_local.rewrite_row_region`), the call computes it with the op
the graph had (``F.linear`` or ``hidden @ weight.T``), keeps it for its backward and writes
each chunk's gradient over that chunk's logits: one ``[T, V]`` buffer in the backward, as
stock's donated buffer; the lm_head's gradients are stock's GEMMs on the whole gradient.
docs/how-it-works.md ("Whole") says why and what it measured.  See NOTE [retained graph].
"""

# NOTE [retained graph]
# A second backward through the same forward (``retain_graph=True``) finds a flag the first
# one cleared and recomputes the matmul before it starts: the same op on the same operands.
# The flag is a one-byte host tensor on every device, so reading it never waits for a GPU;
# both ops carry ``torch.Tag.cudagraph_unsafe``: Inductor's CUDA graphs
# (``mode="reduce-overhead"``) run them outside the captured partitions.

from __future__ import annotations

from typing import Optional

import torch

from ..chunk_gemm import head_logits
from ..ops.args import Region, grads_by_name
from ..ops.pair import call_by_name, saved_inputs
from ..ops.registry import CUDAGRAPH_UNSAFE, REPLAYING_BODIES, UNSAFE, emitted
from .engine import (
    backward_chunks,
    fake_results,
    forward,
    region_grads,
    replay_args,
    row_local,
    setup_region,
    with_logits,
)

__all__ = ["row_local_head"]


def _host_flag(flag: torch.Tensor) -> bool:
    """The flag's value: a host tensor on every device, read from host memory (no device
    sync, no ``aten::item``; not ``.numpy()``: torch does not require numpy); its op is
    ``cudagraph_unsafe`` (a replay would not read it)."""
    assert flag.device.type == "cpu", flag.device
    return bool(flag.tolist()[0])


@torch.library.custom_op("chunked_logits::row_local_head", mutates_args=(), tags=UNSAFE)
def _row_local_head(key: str, rows: list[torch.Tensor], whole: list[torch.Tensor], budget_bytes: int,
                    index: int, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    how: str, flatten: bool) -> list[torch.Tensor]:
    # -> the body's results, the logits (kept for the backward) and a flag (on the host):
    # 1 until a backward writes the gradient over the logits
    x = head_logits(hidden, weight, bias, how, flatten)
    results = forward(Region(key, with_logits(rows, index, x), whole, budget_bytes))
    return [*results, x, torch.ones(1, dtype=torch.uint8)]


@_row_local_head.register_fake
def _(key, rows, whole, budget_bytes, index, hidden, weight, bias, how, flatten):
    x = head_logits(hidden, weight, bias, how, flatten)
    return [*fake_results(key, with_logits(rows, index, x), whole), x, torch.empty(1, dtype=torch.uint8)]


def _grad_shapes(rows, wanted, hidden, weight, bias, needs) -> list[tuple[torch.Size, torch.Tensor]]:
    """(shape, tensor of its dtype and device) of each gradient the backward returns."""
    of = [(rows[i].shape, rows[i]) for i in wanted]
    for need, t in zip(needs, (hidden, weight, bias)):
        if need:
            of.append((t.shape, t))
    return of


@torch.library.custom_op("chunked_logits::row_local_head_backward", mutates_args=(), tags=UNSAFE)
def _row_local_head_backward(key: str, wanted: list[int], outputs: list[int], rows: list[torch.Tensor],
                             whole: list[torch.Tensor], saved: list[torch.Tensor], grads: list[torch.Tensor],
                             budget_bytes: int, index: int, hidden: torch.Tensor, weight: torch.Tensor,
                             bias: Optional[torch.Tensor], how: str, flatten: bool, x: torch.Tensor,
                             flag: torch.Tensor, needs: list[bool]) -> list[torch.Tensor]:
    # ``x`` (the logits this call's forward made and only it reads) and ``flag`` are
    # written in place: no graph value reads them after this op.
    # (their version counters are kept: autograd checks them when a retained graph's
    # backward unpacks them again, and the flag makes that second backward correct)
    keep = torch.autograd._unsafe_preserve_version_counter
    with keep(x), keep(flag):
        if not _host_flag(flag):  # a second backward: the first wrote the gradient over the logits
            x.copy_(head_logits(hidden, weight, bias, how, flatten))
        full = with_logits(rows, index, x)
        others = [(i if i < index else i + 1) for i in wanted]
        out = [torch.empty_like(full[i], memory_format=torch.contiguous_format) for i in others]
        backward_chunks(Region(key, full, whole, budget_bytes), [index, *others], outputs, saved, grads,
                        [x, *out])
        flag.zero_()
    g = x.reshape(-1, x.shape[-1])  # the logits' gradient, model precision, where they were
    if needs[0]:
        out.append((g @ weight).view(hidden.shape))
    if needs[1]:
        out.append(g.t() @ hidden.reshape(-1, hidden.shape[-1]))
    if needs[2]:
        out.append(g.sum(0))
    return out


@_row_local_head_backward.register_fake
def _(key, wanted, outputs, rows, whole, saved, grads, budget_bytes, index, hidden, weight, bias, how,
      flatten, x, flag, needs):
    return [torch.empty(shape, dtype=t.dtype, device=t.device)
            for shape, t in _grad_shapes(rows, wanted, hidden, weight, bias, needs)]


def _setup(ctx, inputs, output):
    # (the results, then the logits the call made and its flag: kept for the backward)
    setup_region(ctx, _row_local_head, inputs, output, kept=2)


def _backward(ctx, grads):
    args, extra = saved_inputs(ctx)
    *state, x, flag = extra
    if not ctx.outputs:
        return grads_by_name(_row_local_head, ctx.lengths)
    got = call_by_name(_row_local_head_backward, args, saved=state, x=x, flag=flag, needs=ctx.needs,
                       **replay_args(ctx, grads, x.device))
    return region_grads(_row_local_head, ctx, args, got)


_row_local_head.register_autograd(_backward, setup_context=_setup)


@emitted(("row_local_head", "row_local_head_backward"), CUDAGRAPH_UNSAFE)
def row_local_head(key: str, budget_bytes: int, n_rows: int, index: int, how: str, flatten: bool,
                   hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   *inputs: torch.Tensor, saving: Optional[str] = None) -> tuple[torch.Tensor, ...]:
    """:func:`~fx_passes.kernels.row_local.engine.row_local` for a region whose row input
    ``index`` is the lm_head's logits (``how``: ``"linear"`` or ``"matmul"``, flattened to
    ``[N, V]`` when ``flatten``): ``inputs`` are the region's other ``n_rows - 1`` row
    inputs, then its whole inputs.  Without a gradient to take the matmul runs before a
    plain ``row_local`` call."""
    rows, whole = list(inputs[:n_rows - 1]), list(inputs[n_rows - 1:])
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                            for t in (hidden, weight, bias))):
        x = head_logits(hidden, weight, bias, how, flatten)
        return row_local(key, budget_bytes, n_rows, *with_logits(rows, index, x), *whole, saving=saving)
    out = _row_local_head(saving or key, rows, whole, budget_bytes, index, hidden, weight, bias, how, flatten)
    count = REPLAYING_BODIES[saving][1] if saving is not None else 0
    return tuple(out[:len(out) - 2 - count])
