"""One compiled function, several incoming gradients (issue 55, item 3): the row-local
loss (gradients in the forward, ``kernels/row_local/loss.py``) called again and again with
``loss.backward(torch.tensor(g))`` for g = 3, 1, 0.3, -2, each step's gradients no further
from FP64 than stock's for the same g (stock also one compiled function), so no state of
one call (a scale folded at the first backward, a buffer the forward reuses, a flag) can
reach the next.  ``"gpu"`` runs on the test-only CPU kernels of ``mm(..., out_dtype=)``;
the other plans resolve to the CPU's ``"two_sweeps"`` loop for this loss, which reads g
(a power of two scales the forward's gradients, anything else runs both sweeps).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from fx_passes.testing.gemms import cpu_out_dtype_kernels
from tests import sweep_cases as sweeps
from tests.helpers import chunked_counters
from tests.numerics import F32, assert_no_less_accurate

GRADIENTS = [3.0, 1.0, 0.3, -2.0]


def _step(fn, inputs, grad_pos, g, up=F32):
    """(loss, gradients) of one call of ``fn`` with ``loss.backward(torch.tensor(g))``."""
    leaves = [t.detach().clone().requires_grad_(i in grad_pos) for i, t in enumerate(inputs)]
    loss = fn(*leaves, up=up) if up is not F32 else fn(*leaves)
    loss.backward(torch.tensor(g, dtype=loss.dtype))
    return [loss.detach()], [leaves[i].grad for i in grad_pos]


@pytest.mark.parametrize("plan", ["gpu", "two_sweeps"])
def test_one_compiled_function_with_gradients_3_1_03_minus_2(plan):
    fn, inputs, grad_pos = sweeps.case("smoothed_ce")
    f64 = [t.double() if t.is_floating_point() else t for t in inputs]
    stock = torch.compile(fn, backend="inductor")
    ours = torch.compile(fn, backend="chunked_logits", options={"lm_head_plan": plan})
    with cpu_out_dtype_kernels() if plan == "gpu" else contextlib.nullcontext():
        for g in GRADIENTS:
            ref = _step(fn, f64, grad_pos, g, up=torch.float64)
            # (tests/test_row_local_loss.py GPU_SCALES: a g that is not a power of two
            # moves the mean error by where the two paths round the logits' gradient)
            assert_no_less_accurate(_step(ours, inputs, grad_pos, g), _step(stock, inputs, grad_pos, g), ref,
                                    torch.bfloat16, 2e-6, 2**-8, mean_ratio=1.2)
    c = chunked_counters()
    assert c.get("gradients_in_forward") == 1 and c.get("rewritten") == 1, c  # (one compile)
