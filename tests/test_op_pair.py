"""kernels/ops/pair.py: a custom op's autograd by its schema's names (what the forward saves,
what the backward reads), and every custom op of the package going through it."""

from __future__ import annotations

import ast
import pathlib
from typing import Optional

import torch

from fx_passes.kernels.ops.args import grads_by_name
from fx_passes.kernels.ops.pair import (
    call_by_name,
    grads_or_zeros,
    keep_result_specs,
    save_inputs,
    saved_inputs,
)

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "fx_passes"


@torch.library.custom_op("fx_passes_test::scaled_sum", mutates_args=())
def _scaled_sum(tag: str, rows: list[torch.Tensor], w: torch.Tensor, bias: Optional[torch.Tensor],
                factor: float) -> list[torch.Tensor]:
    # -> [factor * sum(rows) * w + bias, the rows' count as a tensor (no gradient)]
    total = sum(r * w for r in rows) * factor
    return [total + bias if bias is not None else total, torch.tensor(len(rows))]


@_scaled_sum.register_fake
def _(tag, rows, w, bias, factor):
    return [torch.empty_like(rows[0]), torch.empty((), dtype=torch.int64)]


@torch.library.custom_op("fx_passes_test::scaled_sum_backward", mutates_args=())
def _scaled_sum_backward(rows: list[torch.Tensor], w: torch.Tensor, factor: float, grads: list[torch.Tensor],
                         result: torch.Tensor) -> list[torch.Tensor]:
    g = grads[0] * factor
    return [g * w for _ in rows] + [sum(g * r for r in rows), result * 0 + 1]


def _setup(ctx, inputs, output):
    save_inputs(ctx, _scaled_sum, inputs, extra=output[:1])
    keep_result_specs(ctx, output)


def _backward(ctx, grads):
    args, (result,) = saved_inputs(ctx)
    assert args["tag"] == "t" and args["factor"] in (0.5, 2.0)
    got = call_by_name(_scaled_sum_backward, args, grads=grads_or_zeros(ctx, grads, result.device, [0]),
                       result=result)
    n = len(args["rows"])
    return grads_by_name(_scaled_sum, ctx.lengths, rows=got[:n], w=got[n],
                         bias=grads[0] if args["bias"] is not None else None)


_scaled_sum.register_autograd(_backward, setup_context=_setup)


def _reference(rows, w, bias, factor):
    total = sum(r * w for r in rows) * factor
    return total + bias if bias is not None else total


def test_saved_inputs_come_back_by_name():
    for with_bias in (False, True):
        rows = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
        w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        bias = torch.randn(3, 4, dtype=torch.float64, requires_grad=True) if with_bias else None
        leaves = [*rows, w, *([bias] if with_bias else [])]
        out = _scaled_sum("t", rows, w, bias, 0.5)[0]
        grads = torch.autograd.grad((out * out).sum(), leaves)
        want = torch.autograd.grad((_reference(rows, w, bias, 0.5) ** 2).sum(), leaves)
        for g, r in zip(grads, want):
            torch.testing.assert_close(g, r)


def test_a_result_without_gradient_gets_zeros():
    rows = [torch.randn(2, 2, requires_grad=True)]
    w = torch.randn(2, 2)
    out = _scaled_sum("t", rows, w, None, 2.0)
    (g,) = torch.autograd.grad(out[0].sum(), rows)
    torch.testing.assert_close(g, 2.0 * w)


def _custom_op_modules() -> list[pathlib.Path]:
    return [p for p in PACKAGE.rglob("*.py") if "register_autograd" in p.read_text()]


def test_every_custom_op_saves_and_reads_by_name():
    """No module registering a custom op's autograd saves or slices tensors by position."""
    modules = _custom_op_modules()
    assert len(modules) >= 8, modules  # (the row-local loops, the lm_head loops, the vocab-parallel stages)
    by_position = []
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("saved_tensors", "save_for_backward"):
                by_position.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not by_position, by_position
