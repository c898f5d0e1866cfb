"""Row-local losses (issue 21): top-k / top-p / min-p masked log-probs, distillation
(forward and reverse KL, JSD, ``F.kl_div``), label-smoothed and class-weighted
cross-entropy, per-token weights, sequence-level losses after per-row log-probs.

Each is rewritten into one ``row_local`` call (counters), no further from FP64 than stock
Inductor on its outputs and every gradient, in bf16 and fp16, static and ``dynamic=True``;
the outer graph allocates no FP32 ``[T, V]`` buffer and no op allocates one at run time.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from fx_passes import Reason
from fx_passes.kernels.ops.body_compiler import compiling_with
from fx_passes.kernels.tiling import BYTES_PER_ELEMENT
from tests import row_local_cases as rl
from tests.codegen import compiled_codes, full_fp32_buffers
from tests.helpers import LargestFP32, chunked_counters, rewrite_graphs
from tests.numerics import F32, dtype_matrix, reference, run

EAGER = lambda fn, options: fn  # noqa: E731  (bodies run eagerly: only the outer graph is generated)
T, V, CASES, _inputs, _check = rl.T, rl.V, rl.CASES, rl.inputs, rl.check


@pytest.mark.sampled(4)
@pytest.mark.parametrize("name", CASES)
def test_row_local_loss_rewritten_and_as_accurate_as_stock(name):
    fn, inputs, grad_pos = _inputs(name, torch.bfloat16)
    _check(fn, inputs, grad_pos, torch.bfloat16, 2e-6, 2**-8)


@pytest.mark.sampled(3)
@pytest.mark.parametrize("name,dtype,out_rtol,grad_rtol",
                         dtype_matrix(["topk_topp", "forward_kl", "ce_weight_smoothing",
                                       "ce_smoothing_flattened"]))
def test_dynamic_shapes_and_dtypes(name, dtype, out_rtol, grad_rtol):
    fn, inputs, grad_pos = _inputs(name, dtype)
    _check(fn, inputs, grad_pos, dtype, out_rtol, grad_rtol, dynamic=True)


def test_topp_cut_is_far_from_rounding():
    """The inputs' precondition: no row's top-p cut is within rounding of p, so stock,
    ours and FP64 keep the same tokens (else the test would compare different supports)."""
    x = rl.distinct_logits(T, V, torch.bfloat16).double() / rl.TEMPERATURE
    z = rl.filtered(x, k=50)
    sorted_p, _ = z.softmax(-1).sort(-1, descending=True)
    margin = ((sorted_p.cumsum(-1) - sorted_p) - 0.9).abs()
    assert margin.min().item() > 1e-5


def test_scoring_without_grad():
    fn, inputs, _ = _inputs("topk_topp", torch.bfloat16)
    _check(fn, inputs, (), torch.bfloat16, 2e-6, 2**-8)


def frozen_teacher_kl(hidden, w_student, w_teacher, up=F32):
    """The teacher's lm_head and log-probs under no_grad in the same graph."""
    s = torch.log_softmax((hidden @ w_student.T).to(up), -1)
    with torch.no_grad():
        t = torch.log_softmax((hidden @ w_teacher.T).to(up), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


def test_frozen_teacher_in_the_graph_under_no_grad():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(T, 32, generator=g).bfloat16()
    w_s, w_t = ((torch.randn(V, 32, generator=g) / 4).bfloat16() for _ in range(2))
    _check(frozen_teacher_kl, (hidden, w_s, w_t), (0, 1), torch.bfloat16, 2e-6, 2**-8)


@pytest.mark.parametrize("name", ["topk_topp", "forward_kl", "ce_weight_smoothing"])
def test_no_fp32_logits_buffer(name):
    """Deterministic memory: the outer graph's generated code allocates no FP32 [T, V]
    buffer, and the chunk bodies (run eagerly, in chunks of 8 rows, under a dispatch mode
    that sees every op they run, forward and backward) allocate no FP32 tensor larger
    than a chunk (a teacher's and a student's: 2 x 8 rows); stock allocates several of T x V."""
    fn, inputs, grad_pos = _inputs(name, torch.bfloat16)
    big = LargestFP32()

    torch._dynamo.reset()
    counters.clear()
    budget_mib = 8 * V * BYTES_PER_ELEMENT / 2**20  # 8 rows of the widest working set
    with compiling_with(big.eager_bodies):
        compiled = torch.compile(fn, backend="chunked_logits", options={"chunk_budget_mib": budget_mib,
                                                                         "leave_to_stock": False})
        _, codes = compiled_codes(run, compiled, inputs, grad_pos)
    assert chunked_counters().get("row_local") == 1
    assert full_fp32_buffers(codes, T, V) == []
    assert 0 < big.largest <= 2 * 8 * V, big.largest


def test_config_row_local_off_leaves_them_declined():
    fn, inputs, _ = _inputs("topk", torch.bfloat16)
    counters.clear()
    before, after = rewrite_graphs(fn, *inputs, row_local=False)
    assert after.code == before.code
    assert chunked_counters().get("declined:UNKNOWN_OP") == 1


def across_rows(logits, tokens, up=F32):
    z = logits.to(up).log_softmax(-1)
    centred = z - z.mean(0)  # a mean over the rows, inside the region
    return centred.gather(-1, tokens[:, None]).squeeze(-1)


def stacked_jsd(student, teacher, up=F32):
    return rl.jsd(student, teacher, up=up)


@pytest.mark.parametrize("fn,op", [(across_rows, "mean"), (stacked_jsd, "stack")])
def test_not_row_local_op_is_named_and_graph_left_as_is(fn, op):
    x = rl.distinct_logits(8, 64, torch.bfloat16)
    second = rl.kept_tokens(x) if fn is across_rows else rl.distinct_logits(8, 64, torch.bfloat16, seed=5)
    counters.clear()
    before, after = rewrite_graphs(fn, x, second)
    assert after.code == before.code
    c = chunked_counters()
    assert c.get(f"declined:{Reason.NOT_ROW_LOCAL.name}", 0) >= 1 and "rewritten" not in c, c


def test_lm_head_in_the_graph_stays_a_matmul():
    """A row-local loss on ``hidden @ weight.T``: the region is rewritten, the matmul stays
    whole (the lm_head fusion covers the hand-derived shapes only)."""
    def fn(hidden, weight, tokens, up=F32):
        return rl.topk_logprob(hidden @ weight.T, tokens, up).mean()
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(T, 32, generator=g).bfloat16()
    weight = (torch.randn(V, 32, generator=g) / 4).bfloat16()
    tokens = rl.kept_tokens(hidden @ weight.T)
    c = _check(fn, (hidden, weight, tokens), (0, 1), torch.bfloat16, 2e-6, 2**-8)
    assert not c.get("lm_head_fused")


def test_ce_label_smoothing_with_ignored_rows_everywhere():
    x = rl.distinct_logits(8, 64, torch.bfloat16)
    labels = torch.full((8,), -100)
    fn = rl.ce_label_smoothing
    ref = reference(fn, (x, labels), (0,))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="chunked_logits", options={"leave_to_stock": False})
    ours = run(compiled, (x, labels), (0,))
    assert chunked_counters().get("row_local") == 1
    assert torch.isnan(ours[0][0]) and torch.isnan(ref[0][0])  # 0 / 0, as torch's mean
    assert F.cross_entropy(x.float(), labels, label_smoothing=0.1).isnan()


def reflected_and_random(logits, tokens, up=F32):
    z = logits.to(up)
    p = torch.softmax(2 * z, -1)  # __rmul__
    return (1 - p).log().gather(-1, tokens[:, None]).squeeze(-1)  # __rsub__


def test_reflected_operators_are_pointwise_and_random_ops_are_not():
    x = rl.distinct_logits(8, 64, torch.bfloat16)
    tok = rl.kept_tokens(x)
    counters.clear()
    _, after = rewrite_graphs(reflected_and_random, x, tok)
    assert chunked_counters() == {"rewritten": 1, "row_local": 1}

    def noisy(logits, tokens):  # a chunk loop would draw other numbers than one call does
        z = logits.float() + torch.rand_like(logits.float())
        return z.log_softmax(-1).gather(-1, tokens[:, None])
    counters.clear()
    before, after = rewrite_graphs(noisy, x, tok)
    assert after.code == before.code
    # (FX marks random ops impure: a side effect inside the region, MUTATION, before any
    # row-locality question; match.row_local would also refuse it, untagged pointwise)
    assert chunked_counters() == {"declined": 1, "declined:MUTATION": 1}


def test_chunks_take_the_devices_budget_unless_one_is_set(monkeypatch):
    """Unset, ``chunk_budget_mib`` leaves the budget to the device where the call runs
    (``tiling.device_budget``: 32 MiB on a CPU, up to 4 GiB on a GPU, where 32 MiB would
    make a step thousands of chunks of a few rows at V 151936); set, it is used as is."""
    from fx_passes.kernels import tiling
    from fx_passes.kernels.row_local import engine as kernel

    fn, inputs, _ = _inputs("topk", torch.bfloat16)
    budgets = []
    for options in ({}, {"chunk_budget_mib": 3}):
        _, after = rewrite_graphs(fn, *inputs, **options)
        calls = [n for n in after.graph.nodes if n.target is kernel.row_local]
        budgets += [calls[0].args[1]]
    assert budgets == [tiling.BY_DEVICE, 3 * 2**20], budgets
    rows = [inputs[0]]
    assert tiling.chunk_rows(rows, tiling.BY_DEVICE) == tiling.chunk_rows(rows, tiling.CPU_BUDGET)
    monkeypatch.setattr(tiling, "device_budget", lambda device_type, free: 4096 * 2**20)
    big = 4096 * 2**20
    assert tiling.chunk_rows(rows, tiling.BY_DEVICE) == tiling.aligned(big // (BYTES_PER_ELEMENT * V))
    assert tiling.chunk_rows(rows, 2**20) == tiling.aligned(2**20 // (BYTES_PER_ELEMENT * V))
