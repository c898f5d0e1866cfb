"""A row-local region whose lm_head runs inside its chunk loop: neither the logits nor
their gradient ever exists whole.

The forward computes each row chunk's logits ``hidden[rows] @ weight.T`` and runs the body
on them; the backward runs the ``two_sweeps`` order
(:func:`fx_passes.kernels.log_softmax.lm_head_sweeps.two_sweeps`) on the body split by
:mod:`fx_passes.kernels.row_local.split`: five ``[T, H] x [H, V]`` GEMMs a step with
model-precision inputs (docs/gemms.md).  A split that fails at run time falls
back to ``row_local_head``'s backward, said once in the log.  See NOTE [row-local sweeps].
"""

# NOTE [row-local sweeps]
# The forward computes each row chunk's logits ``hidden[rows] @ weight.T`` and runs the
# body on them (the region's own ops, :mod:`fx_passes.kernels.row_local.engine`).  The backward
# needs ``grad_hidden[t]`` (a sum over the whole vocabulary) and ``grad_weight[v]`` (a sum
# over all rows), each one FP32 sum rounded once, so it runs the ``two_sweeps`` order of
# the hand-derived lm_head (:func:`fx_passes.kernels.log_softmax.lm_head_sweeps.two_sweeps`) on a body split
# into per-row statistics and a pointwise function (:mod:`fx_passes.kernels.row_local.split`):
#
# 1. row chunks over the whole vocabulary: the chunk's logits again, the ``stats`` graph
#    (the gradient of the chunk's logits and the per-row values its pointwise form reads),
#    then ``grad_hidden[rows] = g @ weight``: one GEMM over the whole vocabulary;
# 2. vocabulary blocks over all rows: the block's logits ``hidden @ weight[block].T``, the
#    ``block`` graph (the same gradient from the per-row values), then
#    ``grad_weight[block] = g.T @ hidden`` (and the bias's sum): one GEMM over all rows.
#
# Five ``[T, H] x [H, V]`` GEMMs a step against stock's three (docs/gemms.md): the price
# of holding a chunk instead of ``[T, V]`` logits and their gradient.  Every GEMM has
# model-precision inputs.  The rewrite takes this call only where the body splits
# (``rewrite/row_local.py``); a split that fails at run time all the same (an input of
# another shape) recomputes the logits whole and runs ``row_local_head``'s backward,
# said once in the log.

from __future__ import annotations

import logging
from typing import Iterator, Optional

import torch

from ...reporting.report import say_once
from ..chunk_gemm import head_logits, row_chunk_logits
from ..ops.args import LogitsInput, Region, grads_by_name
from ..ops.body_compiler import compile_body
from ..ops.pair import call_by_name, saved_inputs
from ..ops.registry import CAPTURE_SAFE, emitted
from ..tiling import even_splits, sweep_step
from .engine import (
    COUNTER,
    backward_chunks,
    fake_results,
    fill_rows,
    forward,
    region_grads,
    replay_args,
    setup_region,
    with_logits,
)
from .split import COLUMNS, Split, split_of

__all__ = ["row_local_sweeps", "row_local_sweeps_backward", "row_sweep", "block_sweep", "compiled",
           "stats_into", "picked_in_the_sweep", "flat"]


def flat(hidden: torch.Tensor) -> torch.Tensor:
    return hidden.reshape(-1, hidden.shape[-1])


@torch.library.custom_op("chunked_logits::row_local_sweeps", mutates_args=())
def _row_local_sweeps(key: str, rows: list[torch.Tensor], whole: list[torch.Tensor], budget_bytes: int,
                      index: int, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      how: str) -> list[torch.Tensor]:
    lm = LogitsInput(index, flat(hidden), weight, bias, how)
    return forward(Region(key, rows, whole, budget_bytes), lm)


@_row_local_sweeps.register_fake
def _(key, rows, whole, budget_bytes, index, hidden, weight, bias, how):
    x = head_logits(flat(hidden), weight, bias, how, False)
    return fake_results(key, with_logits(rows, index, x), whole)


def compiled(gm, key: tuple):
    """The traced graph ``gm`` (a split's), compiled by Inductor once per ``key``."""
    def graph(*args):
        return gm(*args)
    return compile_body(key, graph, f"{key[0]}_{key[1]}", COUNTER)


def stats_into(split, key: tuple, index: int):
    """The split's ``stats`` graph compiled once per ``key`` with its first result, the
    gradient of the logits (argument ``index``, a chunk the loop owns), written over those
    logits and returned in their place: Inductor's last kernel reads each logit and writes
    its gradient into the same buffer, so a chunk holds one ``[r, V]`` tile, not two
    (tests/test_loop_memory.py, tests/test_row_local_memory_code.py).  A gathered logit is
    read by the row's sweep first (:func:`picked_in_the_sweep`); a graph with another
    indirect read of the logits, and a gradient of another dtype or shape than the logits
    (not expected), returns the gradient as it is, beside them."""
    gm = picked_in_the_sweep(split.stats, index)
    in_place = gm is not None
    gm = gm if in_place else split.stats

    def graph(*args):
        g, *rest = gm(*args)
        x = args[index]
        if not in_place or g.dtype != x.dtype or g.shape != x.shape:
            return (g, *rest)
        x.copy_(g)
        return (x, *rest)
    return compile_body((*key, "into", index), graph, f"{key[0]}_{key[1]}_into", COUNTER)


_INDIRECT = (torch.ops.aten.gather.default, torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default,
             torch.ops.aten.take.default, torch.ops.aten._unsafe_index.Tensor)


def picked_in_the_sweep(gm: torch.fx.GraphModule, index: int) -> Optional[torch.fx.GraphModule]:
    """``gm`` with each gather of one column a row from its argument ``index`` (the
    logits) or a value computed from it read as a sum with one term (exact), which Inductor
    computes in a sweep over the row before a loop that writes over the logits can start;
    None where another indirect read of the logits remains (NOTE [a body that writes over
    its logits] in ``kernels/log_softmax/loss.py``: torch 2.11's Inductor placed a gather's
    load after the gradient's stores)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    places = [n for n in graph.nodes if n.op == "placeholder"]
    from_logits = {places[index]}
    for n in graph.nodes:
        if n not in from_logits and any(a in from_logits for a in n.all_input_nodes):
            from_logits.add(n)
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in _INDIRECT or n.args[0] not in from_logits:
            continue
        src, idx = n.args[0].meta.get("val"), n.args[2].meta.get("val") if len(n.args) > 2 else None
        if n.target is not torch.ops.aten.gather.default or not isinstance(src, torch.Tensor) \
                or not isinstance(idx, torch.Tensor) or src.dim() != 2 or n.args[1] not in (-1, 1) \
                or idx.dim() != 2 or idx.shape[-1] != 1 or n.kwargs.get("sparse_grad", False):
            return None
        with graph.inserting_before(n):
            vocab = graph.call_function(torch.ops.aten.sym_size.int, (n.args[0], 1))
            columns = graph.call_function(torch.ops.aten.arange.default, (vocab,),
                                          {"dtype": idx.dtype, "device": src.device})
            hit = graph.call_function(torch.ops.aten.eq.Tensor, (columns, n.args[2]))
            one = graph.call_function(torch.where, (hit, n.args[0], 0.0))
            picked = graph.call_function(torch.ops.aten.sum.dim_IntList, (one, [-1], True))
        n.replace_all_uses_with(picked)
        graph.erase_node(n)
    return torch.fx.GraphModule(gm, graph)


def _say_whole(key: str, why: str) -> None:
    say_once(logging.WARNING, "chunked_logits: the row-local body %s did not split at run time (%s): its "
             "backward recomputes the logits whole (same results, stock's memory)", key, why)


def row_sweep(stats, region: Region, lm: LogitsInput, cotangents, reorder: bool) -> Iterator[tuple]:
    """Sweep 1's loop, for each row chunk ``(a, b)``: the chunk's logits, the split's
    compiled ``stats`` graph on them (:func:`stats_into`: their gradient written in their
    place), the region's inputs and ``cotangents(a, b)``; yields ``(a, b, its results)``,
    which the caller drops before it asks for the next chunk (one chunk's logits-sized
    tile alive at a time).  ``reorder``: lay
    the weight out once for the loop (when ``grad_weight``, made after it, takes as much)."""
    n = lm.h.shape[0]
    pieces = even_splits(n, sweep_step(n, lm.weight.shape[0], region.budget_bytes, lm.h.device))
    chunk_logits = row_chunk_logits(lm.weight, lm.bias, lm.how, pieces, reorder)
    for a, b in pieces:
        x = chunk_logits(lm.h[a:b])
        got = stats(*with_logits(region.chunk(a, b), lm.index, x), *region.whole, *cotangents(a, b))
        del x
        yield a, b, got
        del got  # (the caller drops its own: the next chunk's logits and gradient are made without it)


def run_sweeps(split: Split, region: Region, lm: LogitsInput, wanted: list[int], grads: list[torch.Tensor],
            needs: list[bool], out: list[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
    """Both sweeps over the rows of ``region`` / ``lm`` (its kept rows, where some are: their
    inputs gathered per chunk and per block); ``out``: the other wanted row inputs'
    gradients, written in sweep 1."""
    n = lm.h.shape[0]
    # (a split per body, dtypes, wanted)
    stats = stats_into(split, ("sweep_stats", region.key, id(split)), lm.index)
    grad_h = torch.empty_like(lm.h) if needs[0] else None
    values: list[Optional[torch.Tensor]] = [None] * split.values
    for a, b, got in row_sweep(stats, region, lm, lambda a, b: (g[a:b] for g in grads), needs[1]):
        g, others, per_row = got[0], got[1:len(wanted)], got[len(wanted):]
        del got
        if grad_h is not None:
            torch.mm(g, lm.weight, out=grad_h[a:b])
        for i, o in enumerate(out):
            o[a:b] = others[i]
        fill_rows(values, per_row, a, b, n)
        del g, others, per_row  # (before the next chunk's logits and gradient are made)
    return (grad_h, *block_sweep(split, region, lm, grads, values, needs))


def block_sweep(split: Split, region: Region, lm: LogitsInput, grads: list[torch.Tensor], values: list,
                needs: list[bool]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Sweep 2: ``(grad_weight, grad_bias)`` (None where ``needs`` says so) by vocabulary
    blocks over all rows, from the row sweep's per-row ``values``."""
    index, h, weight, bias, how = lm
    n, vocab = h.shape[0], weight.shape[0]
    grad_w = torch.empty_like(weight) if needs[1] else None
    grad_b = torch.empty_like(bias) if bias is not None and needs[2] else None
    if grad_w is None and grad_b is None:
        return grad_w, grad_b
    if n == 0:  # (no rows: no per-block work, zero sums)
        return tuple(t.zero_() if t is not None else None for t in (grad_w, grad_b))
    block = compiled(split.block, ("sweep_block", region.key, id(split)))

    def columns(v0: int, v1: int) -> torch.Tensor:
        return torch.arange(v0, v1, device=h.device)[None]
    # (the logits' place: filled per block)
    args = [*with_logits(region.rows, index, h), *region.whole, *grads]
    gather = set() if region.kept is None else set(range(len(region.rows) + 1)) - {index}
    # (the kept rows of a row input: whole once where it is not sliced, else per block)
    unsliced = {i: args[i][region.kept] for i, sliced in split.inputs if i in gather and not sliced}

    def block_of(i: int, v0: int, v1: int) -> torch.Tensor:
        return args[i][..., v0:v1][region.kept] if i in gather else args[i][..., v0:v1]
    for v0, v1 in even_splits(vocab, sweep_step(vocab, n, region.budget_bytes, h.device)):
        x = head_logits(h, weight[v0:v1], bias[v0:v1] if bias is not None else None, how, False)
        picked = [x if i == index else columns(v0, v1) if i == COLUMNS else
                  block_of(i, v0, v1) if sliced else unsliced.get(i, args[i]) for i, sliced in split.inputs]
        g = block(*picked, *values)
        del x, picked  # (the block's logits and gathered inputs)
        if grad_w is not None:
            torch.mm(g.t(), h, out=grad_w[v0:v1])
        if grad_b is not None:
            grad_b[v0:v1] = g.sum(0, dtype=torch.float32)
        del g  # (before the next block's logits and gradient are made)
    return grad_w, grad_b


@torch.library.custom_op("chunked_logits::row_local_sweeps_backward", mutates_args=())
def row_local_sweeps_backward(key: str, wanted: list[int], outputs: list[int], rows: list[torch.Tensor],
                               whole: list[torch.Tensor], grads: list[torch.Tensor], budget_bytes: int,
                               index: int, hidden: torch.Tensor, weight: torch.Tensor,
                               bias: Optional[torch.Tensor], how: str,
                               needs: list[bool]) -> list[torch.Tensor]:
    h = flat(hidden)
    # the body's row inputs that take a gradient: the logits first
    body_wanted = [index, *(i if i < index else i + 1 for i in wanted)]
    x_like = h.new_empty((0, weight.shape[0]))  # (the logits' dtype, width and device: what the split reads)
    split = split_of(key, body_wanted, outputs, index, with_logits(rows, index, x_like), whole)
    out = [torch.empty_like(rows[i], memory_format=torch.contiguous_format) for i in wanted]
    if isinstance(split, str):  # (not expected: the rewrite split the same body)
        _say_whole(key, split)
        g = head_logits(h, weight, bias, how, False)  # (the logits, then their gradient over them)
        region = Region(key, with_logits(rows, index, g), whole, budget_bytes)
        backward_chunks(region, body_wanted, outputs, [], grads, [g, *out])
        heads = [g @ weight if needs[0] else None, g.t() @ h if needs[1] else None,
                 g.sum(0) if bias is not None and needs[2] else None]
    else:
        heads = list(run_sweeps(split, Region(key, rows, whole, budget_bytes),
                             LogitsInput(index, h, weight, bias, how), body_wanted, grads, needs, out))
    if heads[0] is not None:
        heads[0] = heads[0].view(hidden.shape)
    return [*out, *(t for t in heads if t is not None)]


@row_local_sweeps_backward.register_fake
def _(key, wanted, outputs, rows, whole, grads, budget_bytes, index, hidden, weight, bias, how, needs):
    shapes = [rows[i] for i in wanted]
    shapes += [t for need, t in zip(needs, (hidden, weight, bias)) if need and t is not None]
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in shapes]


def _setup(ctx, inputs, output):
    setup_region(ctx, _row_local_sweeps, inputs, output)


def _backward(ctx, grads):
    args, _ = saved_inputs(ctx)
    if not ctx.outputs:
        return grads_by_name(_row_local_sweeps, ctx.lengths)
    got = call_by_name(row_local_sweeps_backward, args, needs=ctx.needs,
                       **replay_args(ctx, grads, args["hidden"].device))
    return region_grads(_row_local_sweeps, ctx, args, got)


_row_local_sweeps.register_autograd(_backward, setup_context=_setup)


@emitted(("row_local_sweeps", "row_local_sweeps_backward"), CAPTURE_SAFE)
def row_local_sweeps(key: str, budget_bytes: int, n_rows: int, index: int, how: str,
                     hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The per-row results of the row-local region ``key`` whose row input ``index`` is
    the lm_head's logits ``hidden @ weight.T`` (``how``: ``"linear"`` or ``"matmul"``;
    ``[N, V]``, ``hidden`` flattened), computed chunk by chunk: ``inputs`` are the region's
    other ``n_rows - 1`` row inputs, then its whole inputs."""
    rows, whole = list(inputs[:n_rows - 1]), list(inputs[n_rows - 1:])
    return tuple(_row_local_sweeps(key, rows, whole, budget_bytes, index, hidden, weight, bias, how))
