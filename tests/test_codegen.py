"""Memory, asserted deterministically: read the code Inductor generates.

A rewritten region allocates no FP32 buffer of full [T, V] size, forward or
backward, static or symbolic sizes.  The positive control shows the same checker
flags stock Inductor's code for W2 and W3, so a checker that sees nothing fails.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from fx_passes.testing.workloads import WORKLOADS
from tests.codegen import allocations, full_fp32_buffers, step_codes
from tests.helpers import auto_plan_computes_gradients_in_forward

T, V = 256, 4096  # small enough for CPU CI, distinct so [T, V] is recognisable


def _codes(name, backend, dynamic, **options):
    w = WORKLOADS[name]
    extra = {"options": options} if options else {}
    compiled = torch.compile(w.fn, backend=backend, dynamic=dynamic, **extra)
    return step_codes(w, compiled, w.make(T, V))


# W4 twice: its loss is in the graph, so by default the loop computes the gradients in
# the forward (kernels/log_softmax/loss.py); without that, the recomputing backward
# (kernels/log_softmax/lm_head.py)
CASES = [*sorted(WORKLOADS), "W4-recompute"]


@pytest.mark.sampled
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("case", CASES)
def test_no_full_size_fp32_buffer(case, dynamic):
    name = case.split("-")[0]
    options = {"gradients_in_forward": False} if case.endswith("-recompute") else {}
    codes = _codes(name, "chunked_logits", dynamic, **options)
    assert counters["chunked_logits"]["rewritten"] == 1
    if name == "W4":
        in_forward = not options and auto_plan_computes_gradients_in_forward()  # (not on AVX2-only CPUs)
        assert counters["chunked_logits"]["gradients_in_forward"] == int(in_forward)
        # the lm_head loop bodies (one row chunk / vocabulary block each, sized by the
        # budget) are compiled on first use too; the outer graph is what calls the op
        codes = [c for c in codes if "torch.ops.chunked_logits.lm_head_" in c]
    assert len(codes) == (2 if WORKLOADS[name].train else 1)  # forward (+ backward)
    assert full_fp32_buffers(codes, T, V) == []


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", ["W2", "W3"])
def test_checker_flags_stock_inductor(name, dynamic):
    flagged = full_fp32_buffers(_codes(name, "inductor", dynamic), T, V)
    assert flagged, "stock Inductor allocates an FP32 [T, V] buffer here; the checker must see it"
    if not dynamic:
        assert (str(T), str(V)) in flagged


def test_training_gradient_is_model_precision():
    codes = _codes("W3", "chunked_logits", False)
    # the one [T, V] buffer of the backward is the bf16 logits gradient
    big = [(d, t) for c in codes for d, t in allocations(c)
           if d == (str(T), str(V))]
    assert big == [((str(T), str(V)), "torch.bfloat16")]
