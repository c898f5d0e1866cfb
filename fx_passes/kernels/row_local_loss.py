"""Gradients in the forward for a row-local region whose lm_head runs chunk by chunk,
when the graph reduces its per-row results to the scalar loss it returns.

The rewrite (:func:`fx_passes.rewrite.loss_tail.rewrite_row_loss_tail`) joins the
region's body and the loss's row part (:mod:`fx_passes.match.loss_tail`) into one body
``key``: ``(*rows, *tail rows, *whole, *tail whole) -> (the tensors the loss sums)``.
Its cotangents for a unit loss are constants (``d loss / d sum_k``, from the loss's
scalar part, which is affine in the sums), so the forward can run the body's gradient
too.  Per row chunk over the whole vocabulary:

* the logits ``hidden[rows] @ weight.T`` (the one GEMM the forward has anyway);
* the split body's ``stats`` graph (:mod:`fx_passes.kernels.row_split`, with the body's
  results): the chunk's sums, the gradient of its logits and the per-row values a
  vocabulary block's gradient reads;
* ``grad_hidden[rows] = g @ weight``: one GEMM over the whole vocabulary.

The backward then runs only the vocabulary sweep of
:mod:`fx_passes.kernels.row_local_sweeps` (the block's logits, its gradient from the
per-row values, ``grad_weight[block] = g.T @ hidden``): four ``[T, H] x [H, V]`` GEMMs a
step instead of five.  The forward's ``grad_hidden`` is rounded to model precision for a
unit loss, so the backward uses it only where scaling it by the incoming gradient rounds
nothing (:func:`fx_passes.kernels.lm_head_loss.scaled_exactly`: 1, a power of two);
otherwise, and if the body does not split at run time after all, it runs both sweeps
with the scaled cotangents (``row_local_sweeps``' backward: each gradient still one FP32
sum rounded once).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..reporting.report import log
from .lm_head_loss import (
    final_loss,
    power_of_two,
    reductions_of,
    scale_exactly_,
    scaled_exactly,
    unit_weights,
)
from .row_local_head import _full as _insert
from .row_local_head import _logits
from .row_local_sweeps import _row_local_sweeps_backward, block_sweep, compiled, flat, forward, step
from .row_split import Split, split_of
from .tiling import even_splits

__all__ = ["row_local_loss", "row_bytes"]

F64 = torch.float64


def row_bytes(split: Split) -> int:
    """Bytes a row of the split's per-row values takes (packed as ``uint8`` columns)."""
    return sum(torch.Size(rest).numel() * dtype.itemsize for dtype, rest in split.value_specs)


def _pack(buf: torch.Tensor, values) -> None:
    off = 0
    for v in values:
        b = v.reshape(v.shape[0], -1).contiguous().view(torch.uint8)
        buf[:, off:off + b.shape[1]] = b
        off += b.shape[1]


def _unpack(buf: torch.Tensor, split: Split) -> list[torch.Tensor]:
    out, off = [], 0
    for dtype, rest in split.value_specs:
        nb = torch.Size(rest).numel() * dtype.itemsize
        out.append(buf[:, off:off + nb].contiguous().view(dtype).reshape(buf.shape[0], *rest))
        off += nb
    return out


def _split(key: str, rows, whole, index: int, h: torch.Tensor, weight: torch.Tensor, k: int):
    x_like = h.new_empty((0, weight.shape[0]))  # (the logits' dtype, width and device)
    return split_of(key, [index], list(range(k)), index, _insert(rows, index, x_like), whole,
                    with_outputs=True)


@functools.lru_cache(None)
def _say_unsplit(key: str, why: str) -> None:
    log.warning("chunked_logits: the row-local loss %s did not split at run time (%s): its gradients are "
                "computed in the backward, by both sweeps (same results, one GEMM more)", key, why)


def _weights(final_key: str, kinds: str, final_whole, n: int, device) -> list[torch.Tensor]:
    """d loss / d result_k[row] for a unit loss: a sum's weight, a mean's over ``n``."""
    units = unit_weights(final_key, kinds, final_whole, device)
    return [w / n if kind == "mean" else w for w, (kind, _) in zip(units, reductions_of(kinds))]


@torch.library.custom_op("chunked_logits::row_local_loss", mutates_args=())
def _row_local_loss(key: str, rows: list[torch.Tensor], whole: list[torch.Tensor], budget_bytes: int,
                    index: int, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    how: str, final_key: str, kinds: str, n_final: int, width: int,
                    need_hidden: bool) -> list[torch.Tensor]:
    # -> [loss, grad_hidden (unit loss; empty if not needed), the per-row values packed
    #     (``[N, width]`` uint8), 1 if they were computed (the body split) else 0]
    h = flat(hidden)
    n, dev = h.shape[0], h.device
    reductions = reductions_of(kinds)
    final_whole = whole[len(whole) - n_final:]
    sums = [torch.zeros((), dtype=F64, device=dev) for _ in reductions]
    grad_h = torch.empty_like(h) if need_hidden else h.new_empty(0)
    packed = torch.zeros((n, width), dtype=torch.uint8, device=dev)
    split = _split(key, rows, whole, index, h, weight, len(reductions))
    done = isinstance(split, Split) and row_bytes(split) == width
    if not done:
        _say_unsplit(key, split if isinstance(split, str) else "another layout of its per-row values")
    if not done:  # (not expected: the rewrite split the same body) the results only
        for s, o in zip(sums, forward(key, rows, whole, budget_bytes, index, h, weight, bias, how)):
            s += o.sum(dtype=F64)
    else:
        weights = _weights(final_key, kinds, final_whole, n, dev)
        stats = compiled(split.stats, ("loss_stats", key, id(split)))
        k = len(reductions)
        for a, b in even_splits(n, step(n, weight.shape[0], budget_bytes, dev)):
            x = _logits(h[a:b], weight, bias, how, False)
            cotangents = [w.to(dt).expand(b - a).contiguous() for w, (_, dt) in zip(weights, reductions)]
            got = stats(*_insert([r[a:b] for r in rows], index, x), *whole, *cotangents)
            del x
            g, outs, per_row = got[0], got[1:1 + k], got[1 + k:]
            for s, o in zip(sums, outs):
                s += o.sum(dtype=F64)
            if need_hidden:
                torch.mm(g, weight, out=grad_h[a:b])
            _pack(packed[a:b], per_row)
    values = [(s / n if kind == "mean" else s).to(dt) for s, (kind, dt) in zip(sums, reductions)]
    loss = final_loss(final_key, values, final_whole)
    return [loss, grad_h, packed, torch.tensor(int(done), dtype=torch.int8)]


@_row_local_loss.register_fake
def _(key, rows, whole, budget_bytes, index, hidden, weight, bias, how, final_key, kinds, n_final, width,
      need_hidden):
    h = flat(hidden)
    at = [torch.zeros((), dtype=dt, device=h.device) for _, dt in reductions_of(kinds)]
    loss = final_loss(final_key, at, whole[len(whole) - n_final:])
    return [torch.empty_like(loss), torch.empty_like(h) if need_hidden else h.new_empty(0),
            h.new_empty((h.shape[0], width), dtype=torch.uint8), torch.empty((), dtype=torch.int8)]


@torch.library.custom_op("chunked_logits::row_local_loss_backward", mutates_args=())
def _row_local_loss_backward(g: torch.Tensor, key: str, rows: list[torch.Tensor], whole: list[torch.Tensor],
                             budget_bytes: int, index: int, hidden: torch.Tensor, weight: torch.Tensor,
                             bias: Optional[torch.Tensor], how: str, final_key: str, kinds: str, n_final: int,
                             grad_hidden: torch.Tensor, packed: torch.Tensor, done: torch.Tensor,
                             needs: list[bool]) -> list[torch.Tensor]:
    """The gradients ``needs`` asks for (of hidden, weight, bias), for the incoming ``g``."""
    h = flat(hidden)
    n, dev = h.shape[0], h.device
    scale = g.item()
    reductions = reductions_of(kinds)
    weights = _weights(final_key, kinds, whole[len(whole) - n_final:], n, dev)
    split = _split(key, rows, whole, index, h, weight, len(reductions)) if int(done) else None
    if isinstance(split, Split):
        heads = _from_the_forward(split, key, rows, whole, weights, reductions, grad_hidden, packed, scale,
                                  budget_bytes, index, h, weight, bias, how, needs)
        if heads is not None:
            if needs[0]:
                heads[0] = heads[0].view(hidden.shape)
            return heads
    grads = [(w * g).to(dt).expand(n).contiguous() for w, (_, dt) in zip(weights, reductions)]
    # both sweeps, from the scaled cotangents (each gradient still one FP32 sum rounded once)
    return _row_local_sweeps_backward(key, [], list(range(len(reductions))), rows, whole, grads, budget_bytes,
                                      index, hidden, weight, bias, how, needs)


def _from_the_forward(split: Split, key, rows, whole, weights, reductions, grad_hidden, packed, scale: float,
                      budget_bytes, index, h, weight, bias, how, needs) -> Optional[list[torch.Tensor]]:
    """The gradients from the forward's ``grad_hidden`` and per-row values, or None
    where scaling them by ``scale`` would round (the backward then runs both sweeps).
    The per-row values were computed for a unit loss (sums of the cotangents' products
    among them), so the vocabulary sweep runs on the unit cotangents too and its
    gradients are scaled after it: exact for 1, -1, a power of two."""
    if not power_of_two(scale):
        return None
    n = h.shape[0]
    unit = [w.to(dt).expand(n).contiguous() for w, (_, dt) in zip(weights, reductions)]
    heads = [None, *block_sweep(split, key, rows, whole, unit, _unpack(packed, split), budget_bytes, index, h,
                                weight, bias, how, needs)]
    if not all(scale_exactly_(t, scale) for t in heads[1:] if t is not None):
        return None  # (an element under- or overflowed: not expected)
    if needs[0]:  # (after the sweep: its working set and the scaled copy are not held together)
        heads[0] = scaled_exactly(grad_hidden, scale)
        if heads[0] is None:
            return None
    return [t for t in heads if t is not None]


@_row_local_loss_backward.register_fake
def _(g, key, rows, whole, budget_bytes, index, hidden, weight, bias, how, final_key, kinds, n_final,
      grad_hidden, packed, done, needs):
    return [torch.empty_like(t) for need, t in zip(needs, (hidden, weight, bias)) if need and t is not None]


def _setup(ctx, inputs, output):
    key, rows, whole, budget_bytes, index, hidden, weight, bias, how, final_key, kinds, n_final, _, _ = inputs
    ctx.args = (key, budget_bytes, index, how, final_key, kinds, n_final)
    ctx.n_rows, ctx.n_whole = len(rows), len(whole)
    ctx.needs = [t is not None and t.requires_grad for t in (hidden, weight, bias)]
    ctx.save_for_backward(*rows, *whole, hidden, weight, bias, *output[1:])


def _backward(ctx, grads):
    g = grads[0]  # (the loss's; the other results are the backward's own inputs)
    saved = list(ctx.saved_tensors)
    n, m = ctx.n_rows, ctx.n_whole
    rows, whole = saved[:n], saved[n:n + m]
    hidden, weight, bias, grad_hidden, packed, done = saved[n + m:]
    key, budget_bytes, index, how, final_key, kinds, n_final = ctx.args
    head: list[Optional[torch.Tensor]] = [None] * 3
    if g is not None and any(ctx.needs):
        got = iter(_row_local_loss_backward(g, key, rows, whole, budget_bytes, index, hidden, weight, bias,
                                            how, final_key, kinds, n_final, grad_hidden, packed, done,
                                            ctx.needs))
        head = [next(got) if need and t is not None else None
                for need, t in zip(ctx.needs, (hidden, weight, bias))]
    return None, [None] * n, [None] * m, None, None, *head, *([None] * 6)


_row_local_loss.register_autograd(_backward, setup_context=_setup)


def row_local_loss(key: str, budget_bytes: int, n_rows: int, index: int, how: str, hidden: torch.Tensor,
                   weight: torch.Tensor, bias: Optional[torch.Tensor], final_key: str, kinds: str,
                   n_final: int, width: int, *inputs: torch.Tensor) -> torch.Tensor:
    """Called from rewritten graphs: the scalar loss of a row-local region (row input
    ``index``: the logits ``hidden @ weight.T``, ``how``: ``"linear"`` or ``"matmul"``)
    and its loss tail, joined in body ``key``.  ``inputs``: the ``n_rows - 1`` other row
    inputs (the tail's per-row tensors flat), then the tensors read whole, the loss's
    scalar part's ``n_final`` last; ``width``: bytes a row of the split's per-row values."""
    rows, whole = list(inputs[:n_rows - 1]), list(inputs[n_rows - 1:])
    return _row_local_loss(key, rows, whole, budget_bytes, index, hidden, weight, bias, how, final_key, kinds,
                           n_final, width, bool(hidden.requires_grad))[0]
