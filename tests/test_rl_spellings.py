"""The RL frameworks' own log-prob spellings (issue 56), rewritten as written: loops over
the rows (``x[i]`` stacked, row slices / ``split`` / ``chunk`` then ``cat``) are merged into
one region (:mod:`fx_passes.rewrite.row_slices`), an in-place temperature on the fresh FP32
copy is made out of place (:mod:`fx_passes.rewrite.in_place`).  Each is rewritten with the
lm_head fused, no further from FP64 than stock Inductor (outputs and gradients), with no FP32
``[T, V]`` buffer in the generated code (stock's has one); the spellings that are not the
same program (rows missed, twice, out of order, mixed) are left as they are.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from fx_passes.kernels.ops.body_compiler import compiling_with
from fx_passes.testing import rl_spellings as rs
from tests.codegen import compiled_codes, full_fp32_buffers
from tests.helpers import LargestFP32, chunked_counters, rewrite_graphs
from tests.numerics import assert_no_less_accurate, ours_stock_reference, run

B, S, H, V = 4, 16, 32, 1024
CANONICAL = {"in_place_temperature": "in_place_made_out_of_place"}


@pytest.mark.sampled
@pytest.mark.parametrize("name", rs.CASES)
def test_spelling_rewritten_fused_and_as_accurate_as_stock(name):
    fn, inputs = rs.inputs(name, B, S, H, V)
    ours, stock, ref = ours_stock_reference(fn, inputs, (0, 1), leave_to_stock=False)
    _assert_rewritten(name)
    assert_no_less_accurate(ours, stock, ref, torch.bfloat16, 2e-6, 2**-8)


def _assert_rewritten(name):
    c = chunked_counters()
    assert c.get(CANONICAL.get(name, "row_slices_merged")) == 1, c
    assert c.get("rewritten") == 1 and not c.get("declined") and not c.get("pass_failed"), c
    assert c.get("lm_head_fused") or any(k.startswith("row_local_lm_head") for k in c), c


@pytest.mark.sampled
@pytest.mark.parametrize("name", rs.CASES)
def test_no_fp32_logits_buffer(name):
    """Deterministic memory: the outer graph's generated code allocates no FP32 buffer
    of even one sequence's [S, V] (stock's does), and the chunk bodies (run eagerly under a dispatch mode that
    sees every op, forward and backward) no FP32 tensor of more than a quarter of it."""
    fn, inputs = rs.inputs(name, B, S, H, V)
    torch._dynamo.reset()
    _, stock_codes = compiled_codes(run, torch.compile(fn, backend="inductor"), inputs, (0, 1))
    # (what the check below would see: stock's FP32 logits, whole or one sequence at a time)
    assert full_fp32_buffers(stock_codes, S, V) != []
    big = LargestFP32()

    torch._dynamo.reset()
    counters.clear()
    with compiling_with(big.eager_bodies):
        compiled = torch.compile(fn, backend="chunked_logits", options={"chunk_budget_mib": 0.125,
                                                                         "leave_to_stock": False})
        _, codes = compiled_codes(run, compiled, inputs, (0, 1))
    _assert_rewritten(name)
    assert full_fp32_buffers(codes, S, V) == []
    assert big.largest <= B * S * V // 4, big.largest


def _lse(x):
    return torch.logsumexp(x.float(), -1)


def overlapping(x):  # rows 24..39 twice, 40..63 never: 40 + 24 = 64 rows all the same
    return torch.cat([_lse(x[0:40]), _lse(x[24:48])])


def missing(x):  # sequence 3 left out
    return torch.stack([_lse(x[i]) for i in range(3)])


def reordered(x):
    return torch.stack([_lse(x[i]) for i in (1, 0, 2, 3)])


def mixed(x):  # each item reads two sequences
    return torch.stack([_lse(x[i] + x[(i + 1) % 4]) for i in range(4)])


def across_slice(x):  # a mean over the rows of each slice
    return torch.cat([_lse(p - p.float().mean(0)) for p in x.split(16)])


def different_ops(x):
    return torch.cat([_lse(x[:32]), x[32:].float().amax(-1)])


def twice(x):  # the same slice's result twice
    first = _lse(x[0:32])
    return torch.cat([first, first])


@pytest.mark.parametrize("fn", [overlapping, missing, reordered, mixed, across_slice, different_ops, twice])
def test_loops_that_are_not_one_row_local_op_are_left_alone(fn):
    x = torch.randn(4, 16, 64) if fn in (missing, reordered, mixed) else torch.randn(64, 64)
    x = x.bfloat16()
    counters.clear()
    before, after = rewrite_graphs(fn, x)
    assert "row_slices_merged" not in chunked_counters()  # (a slice's own upcast may still be rewritten)
    assert [n.target for n in after.graph.nodes if n.target in (torch.cat, torch.stack)] == [
        n.target for n in before.graph.nodes if n.target in (torch.cat, torch.stack)] != []
    torch.testing.assert_close(after(x)[0], fn(x), atol=1e-5, rtol=1e-5)


def _view_read_before(x, tokens):
    z = x.float()
    first = z[:, :4]  # a view of z, read after the in-place division
    z.div_(rs.TEMPERATURE)
    return first.sum(-1) + torch.log_softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1)


def _promoting(x, tokens):
    z = x.float()
    z.div_(torch.linspace(1, 2, x.shape[-1], dtype=torch.float64))  # out of place: an FP64 result
    return torch.log_softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1)


def _not_fresh(x, tokens):
    x.div_(rs.TEMPERATURE)  # the caller's FP32 tensor
    return torch.log_softmax(x, -1).gather(-1, tokens[:, None]).squeeze(-1)


@pytest.mark.parametrize("fn,dtype", [(_view_read_before, torch.bfloat16), (_promoting, torch.bfloat16),
                                      (_not_fresh, torch.float32)])
def test_in_place_maths_left_in_place_where_it_could_be_seen(fn, dtype):
    x, tokens = torch.randn(8, 64).to(dtype), torch.randint(0, 64, (8,))
    counters.clear()
    before, after = rewrite_graphs(fn, x.clone(), tokens)
    assert "in_place_made_out_of_place" not in chunked_counters()
    assert after.code == before.code


def per_sequence_bf16(hidden, weight, tokens):
    """The per-sequence loop on model-precision logits (no upcast: a bf16 branch)."""
    out = []
    for seq, seq_tokens in zip(hidden @ weight.T, tokens):
        logp = torch.log_softmax(seq, dim=-1)
        out.append(logp.gather(-1, seq_tokens.unsqueeze(-1)).squeeze(-1))
    return torch.stack(out)


def test_per_sequence_bf16_loop_merged_then_upgraded():
    """Merged, a near miss naming upgrade_low_precision and the loop kept; with it, rewritten with the
    lm_head fused and no further from FP64 than stock's bf16 log-probs."""
    _, (h, w, tokens) = rs.inputs("zipped_rows", B, S, H, V)
    counters.clear()
    rewrite_graphs(per_sequence_bf16, h, w, tokens)
    c = chunked_counters()
    # merged, the near miss said, then the user's loop put back: nothing was rewritten
    assert "row_slices_merged" not in c and c.get("near_miss") == 1 and "rewritten" not in c, c
    torch._dynamo.reset()
    counters.clear()
    ours = torch.compile(per_sequence_bf16, backend="chunked_logits",
                         options={"upgrade_low_precision": True})(h, w, tokens)
    c = chunked_counters()
    assert c.get("row_slices_merged") == 1 and c.get("lm_head_fused") == 1 and c.get("rewritten") == 1, c
    ref = torch.log_softmax((h @ w.T).double(), -1).gather(-1, tokens[..., None]).squeeze(-1)  # (bf16 logits)
    stock = torch.compile(per_sequence_bf16, backend="inductor")(h, w, tokens)
    assert ours.dtype == torch.float32
    assert (ours.double() - ref).abs().max() <= (stock.double() - ref).abs().max()
