"""A custom op's autograd by its schema's names: what the forward saves, what the backward reads.

In a ``setup_context``, :func:`save_inputs` saves the op's tensor inputs (a tensor, an
optional tensor, a list of tensors; all of them, or those named) and the extra tensors the
backward reads (results, saved state), and keeps the other inputs on ``ctx``; in the
backward, :func:`saved_inputs` gives them back by name, :func:`call_by_name` passes them on
to the backward op by name and :func:`~fx_passes.kernels.ops.args.grads_by_name` builds the
gradients returned; :func:`keep_result_specs` and :func:`grads_or_zeros` give each result its
incoming gradient or zeros.  No op slices ``ctx.saved_tensors`` by position.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import torch

from .args import args_by_name

__all__ = ["save_inputs", "saved_inputs", "call_by_name", "taken", "keep_result_specs", "grads_or_zeros",
           "HEAD"]

HEAD = ("hidden", "weight", "bias")  # the lm_head inputs an op may return gradients of, in order

_ONE, _LIST = ("Tensor", "Optional[Tensor]"), "List[Tensor]"


def save_inputs(ctx: Any, op: Any, inputs: tuple, extra: Sequence[Any] = (),
                names: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Save the tensor inputs of the custom op ``op`` (those in ``names``, or all) and the
    tensors ``extra`` for the backward; keep its other inputs on ``ctx``.  Returns the
    inputs by name; ``ctx.lengths`` holds each list's length (for ``grads_by_name``)."""
    args = args_by_name(op, inputs)
    layout: list[tuple[str, Optional[int]]] = []
    tensors: list[Any] = []
    plain: dict[str, Any] = {}
    ctx.lengths = {}
    for arg in op._opoverload._schema.arguments:
        kind, value = str(arg.type), args[arg.name]
        if kind == _LIST:
            ctx.lengths[arg.name] = len(value)
        if kind not in (*_ONE, _LIST):
            plain[arg.name] = value
        elif names is None or arg.name in names:
            layout.append((arg.name, len(value) if kind == _LIST else None))
            tensors.extend(value if kind == _LIST else [value])
    ctx.save_for_backward(*tensors, *extra)
    ctx.layout, ctx.plain = layout, plain
    return args


def saved_inputs(ctx: Any) -> tuple[dict[str, Any], list[Any]]:
    """What :func:`save_inputs` kept: the inputs by name (the tensors saved and the other
    inputs) and the ``extra`` tensors, in their order."""
    saved = list(ctx.saved_tensors)
    args, at = dict(ctx.plain), 0
    for name, n in ctx.layout:
        args[name] = saved[at] if n is None else saved[at:at + n]
        at += 1 if n is None else n
    return args, saved[at:]


def call_by_name(op: Any, args: dict[str, Any], **more: Any) -> Any:
    """Call the custom op ``op`` with each argument of its schema by name: from ``more``,
    else from ``args`` (a forward's inputs: the backward op takes them under the same names)."""
    return op(**{a.name: more[a.name] if a.name in more else args[a.name]
                 for a in op._opoverload._schema.arguments if a.name in more or a.name in args})


def taken(got: Iterator[Any], needs: Sequence[bool], args: dict[str, Any],
          names: Sequence[str] = HEAD) -> dict[str, Any]:
    """The gradients a backward op returned (``got``, in order) of the inputs ``names``
    that ``needs`` asks for and are not None, by name (None for the others)."""
    return {name: next(got) if need and args.get(name) is not None else None
            for name, need in zip(names, needs)}


def keep_result_specs(ctx: Any, results: Sequence[torch.Tensor]) -> None:
    """Keep each result's shape and dtype on ``ctx`` (for :func:`grads_or_zeros`)."""
    ctx.result_specs = [(r.shape, r.dtype) for r in results]


def grads_or_zeros(ctx: Any, grads: Sequence[Optional[torch.Tensor]], device: torch.device,
                   which: Optional[Sequence[int]] = None) -> list[torch.Tensor]:
    """The incoming gradients of the results ``which`` (all by default): zeros of the
    result's shape and dtype where none came."""
    picked = range(len(ctx.result_specs)) if which is None else which
    specs = ctx.result_specs
    return [grads[i] if grads[i] is not None else torch.zeros(specs[i][0], dtype=specs[i][1], device=device)
            for i in picked]
