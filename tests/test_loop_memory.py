"""What the lm_head loops hold at once (issue 54: never more memory than stock): the peak of
the live buffers they allocate is the sum of the buffers their maths needs together, each
named, as ``benchmarks/cost_memory.py`` models them (docs/gpu.md, "Predicted peak memory").

* the loss in the graph's ``"gpu"`` loop (``log_softmax/loss.py``, W4L): the FP32 sums and
  one row chunk's logits, their gradient written in their place (not a second tile);
* the row-local loss's ``"gpu"`` loop (``row_local/loss.py``, WD): the FP32 ``grad_weight``
  and ``grad_hidden`` sums and one row chunk's logits, their gradient written in their
  place, not the previous chunk's gradient as well (NOTE [row-local loss memory]);
* its backward, compiled: the ``grad_hidden`` sum freed before ``grad_weight`` is rounded;
* the row-local sweeps (``row_local/sweeps.py``): a row chunk's or a vocabulary block's
  logits and gradient, not the previous one's as well;
* the ``"blocks"`` plan's vocabulary sweep (``lm_head_sweeps._Backward.sweep``): one block's
  FP32 weight copy, gradient and FP32 gradient copy, not the previous block's copy as well.

Measured on this CPU: a dispatch mode counts each storage an op allocates from that op
until a ``weakref.finalize`` on the storage says it is freed, in compiled code and inside
the package's ops; chunk bodies are one op each (their results count, not their
temporaries, which a compiled body's kernel does not keep).  The terms are the model's
(``cost_memory.loss_gpu``, ``row_local_gpu``, ``row_local_sweeps``, ``per_token``), at small shapes.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
from torch.fx import symbolic_trace
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fx_passes.kernels import tiling
from fx_passes.kernels.log_softmax.lm_head_sweeps import lm_head_grads
from fx_passes.kernels.ops import user_bodies
from fx_passes.kernels.ops.args import Cotangents, Head, HeadOptions, RowValues
from fx_passes.kernels.ops.body_compiler import compiling_with
from fx_passes.kernels.row_local.sweeps import row_local_sweeps_backward
from fx_passes.testing import gemms
from fx_passes.testing.gemms import cpu_out_dtype_kernels
from tests import sweep_cases as sweeps
from tests.helpers import chunked_counters

F32, BF16 = torch.float32, torch.bfloat16
LEAST = 4096  # bytes: the buffers counted (per-row vectors, at most [T] int64 here, are not)


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages (of ``LEAST`` bytes or more) that ops allocate, alive at
    once: ``peak`` the most, ``at_peak`` those alive then (shape, dtype).  It sees the ATen
    calls compiled code makes and those inside the package's ops (as ``testing.gemms``'s
    recorder does), not a compiled kernel's own buffers (none here but the bodies')."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # (off while compiling, on while the compiled code runs)

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple] = {}
        self.peak, self.at_peak, self.inside = 0, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "chunked_logits":  # (its kernel's calls with the mode on again)
            keys = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)
            with self:
                out = func.redispatch(keys & gemms._keys(args, kwargs), *args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if not self.inside and not func.is_view:
            self.count(out, (args, kwargs))
        return out

    def count(self, out, inputs=()) -> None:
        given = {t.untyped_storage().data_ptr() for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if storage.nbytes() < LEAST or ptr in given or ptr in self.live:
                continue
            self.live[ptr] = (tuple(t.shape), t.dtype, storage.nbytes())
            weakref.finalize(storage, self.live.pop, ptr, None)
            total = sum(b for *_, b in self.live.values())
            if total > self.peak:
                self.peak, self.at_peak = total, _named((s, d) for s, d, _ in self.live.values())


def _named(buffers) -> list[tuple]:
    """``(shape, dtype)`` pairs in one order."""
    return sorted(((shape, str(dtype)) for shape, dtype in buffers))


_MODES: list[LiveBytes] = []


def _one_op(body, options):
    """A chunk-body compiler (``compiling_with``): the body runs eagerly as one op of the
    innermost :class:`LiveBytes` (its results counted, its temporaries not)."""
    def run(*args):
        if not _MODES:
            return body(*args)
        mode = _MODES[-1]
        mode.inside += 1
        try:
            out = body(*args)
        finally:
            mode.inside -= 1
        mode.count(out, args)
        return out
    return run


@contextlib.contextmanager
def _counting(mode: LiveBytes) -> Iterator[None]:
    _MODES.append(mode)
    try:
        with mode:
            yield
    finally:
        _MODES.pop()


def _measured(step):
    mode = LiveBytes()
    with compiling_with(_one_op), _counting(mode):
        result = step()
    return mode, result


def test_the_blocks_plan_holds_one_block():
    """The ``"blocks"`` backward, 8 vocabulary blocks of all rows: the bf16 gradients, the
    FP32 ``grad_hidden`` sum, and one block's FP32 weight copy, bf16 gradient and its FP32
    copy (``cost_memory.per_token``)."""
    T, H, V = 256, 32, 1024
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(T, H, generator=g).to(BF16), (torch.randn(V, H, generator=g) / 8).to(BF16)
    tokens = torch.randint(0, V, (T,), generator=g)
    lse = torch.logsumexp(hidden.float() @ weight.float().T, -1)
    budget = 8 * T * (V // 8)
    cols, _ = tiling.backward_tiles(budget, T, V, H, False)
    assert cols == V // 8 and tiling.accumulator_rows(budget, T, H) == T
    mode, _ = _measured(lambda: lm_head_grads(Head(hidden, weight, None, tokens), RowValues(lse),
                                              Cotangents(*torch.randn(3, T, generator=g)),
                                              HeadOptions(False, False, budget, plan="blocks")))
    grads = [((T, H), BF16), ((V, H), BF16), ((T, H), F32)]  # grad_hidden, grad_weight, grad_hidden's sum
    block = [((cols, H), F32), ((T, cols), BF16), ((T, cols), F32)]
    assert mode.at_peak == _named([*grads, *block]), mode.at_peak
    assert mode.peak == 2 * T * H + 2 * V * H + 4 * T * H + 4 * cols * H + 6 * T * cols


def test_the_row_local_loss_holds_one_chunk_and_frees_grad_hidden_first():
    """WD's step compiled, plan ``"gpu"`` (the test-only CPU kernels of ``mm(..., out_dtype=)``),
    4 row chunks by the budget: the forward holds the FP32 sums and one chunk's bf16 logits,
    their gradient written in their place (not a second tile); the backward rounds
    ``grad_hidden`` and frees its FP32 sum before it makes ``grad_weight``."""
    fn, inputs, _ = sweeps.case("forward_kl")
    T, V, H = sweeps.T, sweeps.V, sweeps.H
    rows = T // 4
    budget = tiling.SWEEP_BYTES_PER_ELEMENT * V * rows  # (tiling.sweep_step: 4 chunks)
    assert len(tiling.even_splits(T, tiling.sweep_step(T, V, budget, inputs[0].device))) == 4
    compiled = torch.compile(fn, backend="chunked_logits",
                             options={"lm_head_plan": "gpu", "chunk_budget_mib": budget / 2**20})
    h, w, teacher = (t.detach().clone().requires_grad_(i < 2) for i, t in enumerate(inputs))
    with cpu_out_dtype_kernels(), compiling_with(_one_op):
        torch.autograd.grad(compiled(h, w, teacher), [h, w])  # (compiles the graphs and the bodies)
        assert chunked_counters().get("gradients_in_forward") == 1, chunked_counters()
        mode = LiveBytes()
        with _counting(mode):
            loss = compiled(h, w, teacher)
            forward = mode.peak, mode.at_peak
            mode.peak = 0  # (the backward's peak, with what the forward left)
            torch.autograd.grad(loss, [h, w])
    sums = [((V, H), F32), ((T, H), F32)]
    # (one chunk's logits, their gradient written in their place: sweeps.stats_into)
    assert forward == (4 * V * H + 4 * T * H + 2 * rows * V, _named([*sums, ((rows, V), BF16)]))
    # the backward's end: grad_weight's FP32 sum, grad_hidden and grad_weight rounded (6 V H + 2 T H)
    assert mode.at_peak == _named([sums[0], ((T, H), BF16), ((V, H), BF16)]), mode.at_peak
    assert mode.peak == 4 * V * H + 2 * T * H + 2 * V * H


def test_the_row_local_sweeps_hold_one_chunk_or_block():
    """Both sweeps of the five-GEMM backward (``row_local_sweeps_backward``), 4 row chunks
    and 4 vocabulary blocks: at the block sweep's peak, the bf16 gradients and one block's
    logits and gradient (``cost_memory.row_local_sweeps``)."""
    T, V, H = sweeps.T, sweeps.V, sweeps.H
    hidden, weight = sweeps.head()
    teacher = torch.randn(T, V, generator=torch.Generator().manual_seed(2)).to(BF16)
    key = user_bodies.register(symbolic_trace(sweeps.kl_rows))
    budget = tiling.SWEEP_BYTES_PER_ELEMENT * V * (T // 4)
    cols = tiling.sweep_step(V, T, budget, hidden.device)
    assert (tiling.sweep_step(T, V, budget, hidden.device), cols) == (T // 4, V // 4)

    def both_sweeps():
        cot = [torch.full((T,), 1.0 / T)]
        return row_local_sweeps_backward._init_fn(key, [], [0], [teacher], [], cot, budget, 0, hidden, weight,
                                                  None, "matmul", [True, True, False])
    with compiling_with(_one_op):
        both_sweeps()  # (the body's split, traced once per shape)
    mode, _ = _measured(both_sweeps)
    block = [((T, cols), BF16)] * 2  # its logits, its gradient
    assert mode.at_peak == _named([((T, H), BF16), ((V, H), BF16), *block]), mode.at_peak
    assert mode.peak == 2 * T * H + 2 * V * H + 2 * (2 * T * cols)


def test_the_loss_loop_holds_one_tile_a_chunk():
    """The loss in the graph's step compiled, plan ``"gpu"`` (the test-only CPU kernels), 2 row
    chunks (``tiling.MAX_LOSS_CHUNKS`` with the device's budget): the forward holds the FP32
    sums and one chunk's bf16 logits, whose gradient is written in their place
    (``loss.logits_grad_into``), not a second ``[r, V]`` tile (``cost_memory.loss_gpu``)."""
    T, V, H = sweeps.T, sweeps.V, sweeps.H
    hidden, weight = sweeps.head()
    labels = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(3))
    rows = tiling.gpu_loss_rows(tiling.CPU_BUDGET, T, V)
    chunks = len(tiling.even_splits(T, rows))
    assert chunks == tiling.MAX_LOSS_CHUNKS == 2

    def ce(h, w, y):
        return torch.nn.functional.cross_entropy((h @ w.T).float(), y)
    compiled = torch.compile(ce, backend="chunked_logits", options={"lm_head_plan": "gpu",
                                                                   "skip_masked_rows": False})
    h, w = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    with cpu_out_dtype_kernels(), compiling_with(_one_op):
        torch.autograd.grad(compiled(h, w, labels), [h, w])  # (compiles the graphs and the bodies)
        assert chunked_counters().get("gradients_in_forward") == 1, chunked_counters()
        mode = LiveBytes()
        with _counting(mode):
            compiled(h, w, labels)
    sums = [((V, H), F32), ((T, H), F32)]
    assert mode.at_peak == _named([*sums, ((rows, V), BF16)]), mode.at_peak
    assert mode.peak == 4 * V * H + 4 * T * H + 2 * rows * V
