"""Row-local regions at run time: the user's own ops, chunk by chunk of rows.

A row-local region (:mod:`fx_passes.match.row_local`) is an FX graph
``fn(*rows, *whole) -> tuple`` of per-row results, registered in
:data:`~fx_passes.kernels.ops.registry.GRAPH_BODIES`.  :func:`forward` is the one forward loop
of every row-local op: the body on slices of ``rows`` along dim 0, ``whole`` passed to every
chunk, the logits given or made per chunk (``row_local_head`` makes them whole first,
``row_local_sweeps`` / ``row_local_loss`` per chunk).  :func:`setup_region` /
:func:`region_grads` are their autograd's one setup and gradient mapping.  ``row_local``'s
backward recomputes each chunk and takes the vector-Jacobian product of the same ops,
writing each row input's gradient in its own dtype (one rounding, as stock's cast
backward).  See NOTE [row-local chunks].
"""

# NOTE [row-local chunks]
# results.  Inductor compiles the body once (``dynamic=True``: every chunk size, the last
# one included, runs the same kernels), so the FP32 ``[.., V]`` values of a chunk exist
# only as that chunk's temporaries: a sort, a cumsum, a top-k mask of ``rows_per_chunk``
# rows, or nothing at all where Inductor fuses the chunk's ops into its reductions.

from __future__ import annotations

from typing import Any, Optional

import torch

from ..chunk_gemm import head_logits
from ..ops import user_bodies
from ..ops.args import LogitsInput, Region, args_by_name, grads_by_name
from ..ops.pair import HEAD, call_by_name, grads_or_zeros, keep_result_specs, save_inputs, saved_inputs, taken
from ..ops.registry import CAPTURE_SAFE, REPLAYING_BODIES, emitted
from ..tiling import chunk_rows, spans, sweep_step

__all__ = ["row_local", "forward", "fill_chunks", "backward_chunks", "with_logits", "fill_rows",
           "setup_outputs", "setup_region", "region_grads", "replay_args", "fake_results"]

COUNTER = "row_local_body_eager"


def fake_results(key: str, rows, whole) -> list[torch.Tensor]:
    """Empty tensors shaped like body ``key``'s results (the custom ops' fake kernels)."""
    results = user_bodies.fake_function(key)(*rows, *whole)
    return [torch.empty(o.shape, dtype=o.dtype, device=o.device) for o in results]


def with_logits(rows: list, index: int, x: Any) -> list:
    """A region's row inputs with the lm_head's logits ``x`` (made by the call) in place ``index``."""
    return [*rows[:index], x, *rows[index:]]


def fill_rows(out: list[Optional[torch.Tensor]], got, a: int, b: int, n: int) -> None:
    """Write one chunk's results into rows ``a:b`` of ``out`` (made at the first chunk)."""
    for i, g in enumerate(got):
        if out[i] is None:
            out[i] = g.new_empty((n, *g.shape[1:]))
        out[i][a:b] = g


def forward(region: Region, lm: Optional[LogitsInput] = None) -> list[torch.Tensor]:
    """The one forward loop of the row-local ops: the compiled body ``region.key`` on each
    chunk of rows, its results written in place (no list of parts to concatenate).  The row
    inputs are given (``lm`` None: chunks of ``region.budget_bytes`` of them), or row input
    ``lm.index`` is the lm_head's logits, made per chunk (chunks of the sweep's step).
    (``region.key`` may name a saving body: what it saves for the backward, packed masks or
    normalisers, ``rewrite/saved.py``, are results past the region's own.)"""
    if lm is None:
        n = region.rows[0].shape[0]
        step = chunk_rows(region.rows, region.budget_bytes)

        def inputs(a: int, b: int) -> tuple:
            return (*region.chunk(a, b), *region.whole)
    else:
        n = lm.h.shape[0]
        step = sweep_step(n, lm.weight.shape[0], region.budget_bytes, lm.h.device)

        def inputs(a: int, b: int) -> tuple:
            x = head_logits(lm.h[a:b], lm.weight, lm.bias, lm.how, False)
            return (*with_logits(region.chunk(a, b), lm.index, x), *region.whole)
    return fill_chunks(user_bodies.body(region.key, COUNTER), spans(n, step), n, inputs)


def fill_chunks(body, spans, n: int, inputs) -> list[torch.Tensor]:
    """``body(*inputs(a, b))`` for each span ``(a, b)`` of ``n`` rows, its results written
    into rows ``a:b`` of tensors made at the first span."""
    out: list[Optional[torch.Tensor]] = []
    for a, b in spans:
        got = list(body(*inputs(a, b)))
        out = out or [None] * len(got)
        fill_rows(out, got, a, b, n)
    return [o for o in out if o is not None]


def backward_chunks(region: Region, wanted: list[int], outputs: list[int], saved: list[torch.Tensor],
                    grads: list[torch.Tensor], out: list[torch.Tensor]) -> None:
    """The vector-Jacobian product of the region's body chunk by chunk: the gradient of
    ``region.rows[wanted[k]]`` written into ``out[k]`` (which may be that row input itself:
    a chunk's rows are read only by its own step)."""
    rows, whole = region.rows, region.whole
    # (the compiled product stores each gradient straight into its buffer; one that is
    # the row input itself, the lm_head call's logits, is written over as that input:
    # a second view of it would make the compiled call's inputs alias)
    into = tuple(next((j for j, r in enumerate(rows) if o is r), None) for o in out)
    storages = {r.untyped_storage().data_ptr() for r in rows}
    if any(t is None and o.untyped_storage().data_ptr() in storages for t, o in zip(into, out)):
        into = None  # (a buffer overlapping a row input some other way: returned, then copied)
    vjp = user_bodies.backward_body(region.key, tuple(wanted), tuple(outputs), COUNTER, into=into)
    for a, b in spans(rows[0].shape[0], chunk_rows(rows, region.budget_bytes)):
        args = (*(r[a:b] for r in rows), *whole, *(s[a:b] for s in saved), *(g[a:b] for g in grads))
        if into is not None:
            vjp(*args, *(o[a:b] for t, o in zip(into, out) if t is None))
            continue
        for o, g in zip(out, vjp(*args)):
            o[a:b] = g


@torch.library.custom_op("chunked_logits::row_local", mutates_args=())
def _row_local(key: str, rows: list[torch.Tensor], whole: list[torch.Tensor],
               budget_bytes: int) -> list[torch.Tensor]:
    return forward(Region(key, rows, whole, budget_bytes))


@_row_local.register_fake
def _(key, rows, whole, budget_bytes):
    return fake_results(key, rows, whole)


@torch.library.custom_op("chunked_logits::row_local_backward", mutates_args=())
def _row_local_backward(key: str, wanted: list[int], outputs: list[int], rows: list[torch.Tensor],
                        whole: list[torch.Tensor], saved: list[torch.Tensor], grads: list[torch.Tensor],
                        budget_bytes: int) -> list[torch.Tensor]:
    # ``key``: the region's body, or its replaying body when the forward ``saved`` state for it
    out = [torch.empty_like(rows[i], memory_format=torch.contiguous_format) for i in wanted]
    backward_chunks(Region(key, rows, whole, budget_bytes), wanted, outputs, saved, grads, out)
    return out


@_row_local_backward.register_fake
def _(key, wanted, outputs, rows, whole, saved, grads, budget_bytes):
    return [torch.empty_like(rows[i], memory_format=torch.contiguous_format) for i in wanted]


def _setup(ctx, inputs, output):
    setup_region(ctx, _row_local, inputs, output)


def setup_region(ctx, op, inputs, output, kept: int = 0) -> dict:
    """A row-local op's ``setup_context``: the body its backward replays and the results
    taking a gradient (:func:`setup_outputs`), the row inputs (``ctx.wanted``) and lm_head
    inputs (``ctx.needs``) taking one; saves the inputs, the saving body's state and the
    ``kept`` last results.  Returns the inputs by name."""
    n = len(output) - kept
    state = setup_outputs(ctx, args_by_name(op, inputs)["key"], output[:n])
    args = save_inputs(ctx, op, inputs, extra=[*state, *output[n:]])
    ctx.wanted = [i for i, r in enumerate(args["rows"]) if r.requires_grad]
    ctx.needs = [args.get(name) is not None and args[name].requires_grad for name in HEAD]
    return args


def region_grads(op, ctx, args: dict, got) -> tuple:
    """A row-local op's gradients by name, from its backward op's results ``got``: the
    wanted row inputs', then those of the lm_head inputs ``ctx.needs`` asks for."""
    got = iter(got)
    rows: list[Optional[torch.Tensor]] = [None] * len(args["rows"])
    for i in ctx.wanted:
        rows[i] = next(got)
    return grads_by_name(op, ctx.lengths, rows=rows, **taken(got, ctx.needs, args))


def setup_outputs(ctx, key: str, output) -> list[torch.Tensor]:
    """Record on ``ctx`` the body the backward replays (``ctx.key``), which results take a
    gradient and their shapes; returns the state the saving body ``key`` saved."""
    ctx.key, n_saved = REPLAYING_BODIES.get(key, (key, 0))
    results = output[:len(output) - n_saved]
    ctx.outputs = [i for i, o in enumerate(results) if o.is_floating_point()]
    keep_result_specs(ctx, results)
    return list(output[len(results):])


def replay_args(ctx, grads, device: torch.device) -> dict:
    """The arguments of a row-local backward op that ``setup_outputs`` decided (the body it
    replays, the row inputs ``ctx.wanted`` and results taking a gradient, their gradients)."""
    return {"key": ctx.key, "wanted": ctx.wanted, "outputs": ctx.outputs,
            "grads": grads_or_zeros(ctx, grads, device, ctx.outputs)}


def _backward(ctx, grads):
    args, state = saved_inputs(ctx)
    if not (ctx.wanted and ctx.outputs):
        return grads_by_name(_row_local, ctx.lengths)
    device = args["rows"][0].device
    got = call_by_name(_row_local_backward, args, saved=state, **replay_args(ctx, grads, device))
    return region_grads(_row_local, ctx, args, got)


_row_local.register_autograd(_backward, setup_context=_setup)


@emitted(("row_local", "row_local_backward"), CAPTURE_SAFE)
def row_local(key: str, budget_bytes: int, n_rows: int, *inputs: torch.Tensor,
              saving: Optional[str] = None) -> tuple[torch.Tensor, ...]:
    """The per-row results of the row-local region registered under ``key``: ``inputs``
    are its ``n_rows`` row inputs (sliced along dim 0), then its whole inputs.  ``saving``:
    the key of the region's body that also returns state for the backward (masks,
    normalisers: :mod:`fx_passes.rewrite.saved`), run in place of ``key``'s when a
    gradient will be taken; its backward replays the ops from that state on."""
    rows, whole = list(inputs[:n_rows]), list(inputs[n_rows:])
    if saving is not None and torch.is_grad_enabled() and any(r.requires_grad for r in rows):
        count = REPLAYING_BODIES[saving][1]
        return tuple(_row_local(saving, rows, whole, budget_bytes)[:-count])
    return tuple(_row_local(key, rows, whole, budget_bytes))
