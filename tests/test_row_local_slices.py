"""A row-local region whose upcast is sliced along its rows (NOTE [slice first],
``fx_passes/rewrite/slice_first.py``): ``F.linear(h, w).float()[:-1]``, a shift written after
the upcast, in ``[T, V]``.  The slice is moved before the upcast and before the lm_head
matmul, so the region is rewritten with its lm_head run chunk by chunk, where it was
declined (and, before, declined with a wrong reason: "FP32 already"); a row view of the
lm_head's logits before the upcast (``F.linear(h, w)[:, :-1].float()``) is moved before
the matmul too, and a teacher's upcast the region reads sliced the same way
(``teacher.float()[:-1]``) before its upcast.  Each is no further from FP64 than stock
Inductor (outputs and gradients) and its generated code holds no FP32 ``[T, V]`` buffer
(stock's holds one).  A region
that is declined after the move leaves the graph as it was, with the reason naming the
user's own nodes.

The losses divide by a per-row temperature: the hand-derived path declines that, the
row-local path takes it, and (unlike a top-k) no tie between logits decides a result.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from fx_passes.kernels.ops.body_compiler import compiling_with
from fx_passes.reporting.session import session
from tests.codegen import compiled_codes, full_fp32_buffers
from tests.helpers import LargestFP32, chunked_counters, rewrite_graphs
from tests.numerics import F32, assert_no_less_accurate, ours_stock_reference, run

T, H, V = 64, 32, 512
B, S = 4, 16


def shift_after(hidden, weight, tokens, temps, up=F32):
    """[T, V]: the rows sliced after the upcast (a shift)."""
    z = F.linear(hidden, weight).to(up)[:-1] / temps[:-1, None]
    return torch.log_softmax(z, -1).gather(-1, tokens[1:, None]).squeeze(-1)


def shift_after_3d(hidden, weight, tokens, temps, up=F32):
    """[B, S, V]: positions sliced after the upcast (dim 0, the rows, kept whole)."""
    z = F.linear(hidden, weight).to(up)[:, :-1] / temps[:, None, None]
    return torch.log_softmax(z, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def shift_before_3d(hidden, weight, tokens, temps, up=F32):
    """[B, S, V]: positions sliced before the upcast, the lm_head's logits read nowhere else."""
    z = F.linear(hidden, weight)[:, :-1].to(up) / temps[:, None, None]
    return torch.log_softmax(z, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def policy_loss_shift_after(hidden, weight, tokens, temps, up=F32):
    """A loss in the graph over the shifted rows."""
    return -shift_after(hidden, weight, tokens, temps, up).mean()


def given_logits_shift_after(logits, tokens, temps, up=F32):
    """No lm_head in the graph: the logits given."""
    z = logits.to(up)[:-1] / temps[:-1, None]
    return torch.log_softmax(z, -1).gather(-1, tokens[1:, None]).squeeze(-1)


def distillation_shift_after(hidden, weight, teacher, temps, up=F32):
    """KL to a teacher, both logits shifted after their upcast (the teacher's slice moves too)."""
    s = F.linear(hidden, weight).to(up)[:-1] / temps[:-1, None]
    t = teacher.to(up)[:-1]
    return F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="batchmean")


CASES = {  # name -> (function, 3-D, an lm_head, the lm_head's counter)
    "shift_after": (shift_after, False, "row_local_lm_head"),
    "policy_loss_shift_after": (policy_loss_shift_after, False, "row_local_lm_head"),
    "shift_after_3d": (shift_after_3d, True, "row_local_lm_head_in_call"),
    "shift_before_3d": (shift_before_3d, True, "row_local_lm_head_in_call"),
    "given_logits_shift_after": (given_logits_shift_after, False, None),
    "distillation_shift_after": (distillation_shift_after, False, "row_local_lm_head"),
}


def _inputs(name: str):
    fn, three_d, head = CASES[name]
    g = torch.Generator().manual_seed(3)
    rows = (B, S) if three_d else (T,)
    tokens = torch.randint(0, V, rows, generator=g)
    if name.startswith("distillation"):  # (the teacher's bf16 logits where the tokens go)
        tokens = torch.randn(*rows, V, generator=g).bfloat16()
    temps = torch.rand(rows[0], generator=g) + 0.5
    if head is None:
        return fn, (torch.randn(*rows, V, generator=g).bfloat16(), tokens, temps), (0,)
    hidden = torch.randn(*rows, H, generator=g).bfloat16()
    weight = (torch.randn(V, H, generator=g) / H ** 0.5).bfloat16()
    return fn, (hidden, weight, tokens, temps), (0, 1)


def _assert_rewritten(name: str) -> None:
    c = chunked_counters()
    head = CASES[name][2]
    assert c.get("rewritten") == 1 and c.get("row_local") == 1 and not c.get("declined"), c
    assert head is None or c.get(head) == 1, c
    assert not c.get("masked_rows_not_skipped"), c  # (a token id is no mask)


@pytest.mark.sampled
@pytest.mark.parametrize("name", CASES)
def test_sliced_upcast_rewritten_and_as_accurate_as_stock(name):
    fn, inputs, grad_pos = _inputs(name)
    ours, stock, ref = ours_stock_reference(fn, inputs, grad_pos, leave_to_stock=False)
    _assert_rewritten(name)
    assert_no_less_accurate(ours, stock, ref, torch.bfloat16, 2e-6, 2**-8)


@pytest.mark.parametrize("name", ["shift_after", "shift_before_3d", "distillation_shift_after"])
def test_no_fp32_logits_buffer(name):
    """The outer graph's generated code allocates no FP32 buffer of the sliced logits
    (stock's does), and the chunk bodies (run eagerly under a dispatch mode that sees
    every op, forward and backward) no FP32 tensor of more than a quarter of them."""
    fn, inputs, grad_pos = _inputs(name)
    rows, vocab = (S - 1, V) if name == "shift_before_3d" else (T - 1, V)  # (3-D: one sequence's)
    torch._dynamo.reset()
    _, stock_codes = compiled_codes(run, torch.compile(fn, backend="inductor"), inputs, grad_pos)
    assert full_fp32_buffers(stock_codes, rows, vocab) != []  # (what the check below would see)
    big = LargestFP32()
    torch._dynamo.reset()
    counters.clear()
    with compiling_with(big.eager_bodies):
        compiled = torch.compile(fn, backend="chunked_logits", options={"leave_to_stock": False,
                                                                         "chunk_budget_mib": 0.03125})
        _, codes = compiled_codes(run, compiled, inputs, grad_pos)
    _assert_rewritten(name)
    assert full_fp32_buffers(codes, rows, vocab) == []
    assert big.largest <= (T - 1) * V // 4, big.largest


def mixes_rows(hidden, weight, tokens, temps, up=F32):
    """The slice is moved, then the region meets a cumsum over the rows: declined."""
    z = F.linear(hidden, weight).to(up)[:-1] / temps[:-1, None]
    return torch.log_softmax(z.cumsum(0), -1).gather(-1, tokens[1:, None]).squeeze(-1)


def test_declined_after_the_move_leaves_the_graph_as_it_was():
    _, inputs, _ = _inputs("shift_after")
    counters.clear()
    session.reset()
    before, after = rewrite_graphs(mixes_rows, *inputs, leave_to_stock=False)
    c = chunked_counters()
    assert c.get("declined:NOT_ROW_LOCAL") == 1 and not c.get("rewritten"), c
    assert after.code == before.code
    names = {n.name for n in before.graph.nodes}
    detail = [e for e in session.events if e.kind == "declined"][0].what
    assert "cumsum" in detail and "FP32 already" not in detail
    assert all(word in names for word in detail.replace("(", " ").replace(")", " ").split()
               if word.startswith(("float", "getitem", "truediv", "linear"))), detail
