"""The pass on fake CUDA tensors with a CPU-only torch (``make test``): per path, the
rewrite taken, the lm_head plan a CUDA device gets, and that every tensor the rewritten
graph holds (example values: the emitted calls' results and constants included, and
what the emitted calls' fake kernels return) is on the CUDA device, none on the host.

How (tests/fake_cuda_child.py, a process of its own): each path's Dynamo graph is
captured on CPU tensors, its example values made fake CUDA tensors (same shapes,
strides, dtypes, ``requires_grad``; symbolic sizes for the dynamic case), and the passes
run on it under ``no_grad``; then the emitted calls run on those values (their fake
kernels), the graph's other ops give their example values.  Twice: as this torch is
built (no CUDA ``aten::mm.dtype``: the ``"blocks"`` plan) and with ``mm.dtype`` /
``addmm.dtype`` registered for the CUDA key as a CUDA build has them (the ``"gpu"`` plan).

What a CPU-only torch cannot run, and why (so not checked here; the GPU check runs it):
* autograd on a fake CUDA tensor aborts the process (no CUDA device-guard implementation
  in the build), so no backward graph and no backward op's fake kernel;
* ``Tensor.__getitem__``'s Python binding sets a device guard ("PyTorch is not linked with
  support for cuda devices"): the graph's own ops are not re-run, and the ``row_local``
  fake kernel, which runs the region's body (indexing included), is refused;
* the loss-tail rewrite (``lm_head_loss``, the ``"gpu"`` plan's loss in the graph,
  ``rewrite/tail_graphs.py`` ``_bodies``) and the lm_head row-local loss
  (``kernels/row_local/split.py`` ``_examples``) trace their bodies on real tensors of the
  inputs' device at compile time: "Torch not compiled with CUDA enabled".  There the pass
  fails and leaves the user's graph as it was (checked: never a broken compile).
* vocab-parallel: its rewrite needs the process group of a sharded lm_head
  (tests/test_vocab_parallel.py runs gloo groups on CPU tensors); not run here.
No CUDA wheel is installed for this (several GB in ``make test``); the GPU check
(benchmarks/gpu_check.py) covers the rest on a GPU.  With a CUDA build of torch (on a
machine with no GPU too) the module is skipped: there a device tensor the rewrite makes
initialises the CUDA driver.

The ``"gpu"`` plan's chunk loops themselves (issue 54, item 2; tests/fake_cuda_loops.py,
in the same process): the loss in the graph (``lm_head_loss``'s own function, then its
backward), the per-token backward and ``"kept_logits"``' backward, on fake CUDA tensors
at the recorded H200 run's sizes (T 8192, V 151936, H 4096, bf16) with an 80 GB and a 141
GB device's budget, every
ATen call recorded in order: the chunk count, each chunk's GEMMs, every call that touches
an FP32 sum, the one downcast.  What runs otherwise than on a GPU there, and why:
* the chunk bodies run eagerly (Inductor makes no CUDA kernels without a CUDA build): their
  row kernels are not asserted, and the logits GEMM is ``aten.linear`` (Inductor's extern
  ``mm`` on a GPU);
* ``compat.probe_addmm_into`` reads a real CUDA tensor back: its answer is set as a CUDA
  build gives it (torch newer than 2.8; 2.8's answer in a case of its own), and so is the
  device's total memory;
* the rewrite that emits the loss call runs on CPU tensors (on fake CUDA it traces on the
  device, above); the backward is called on a plain context (autograd aborts);
* the loss loop runs every row (``skip_masked_rows`` off): choosing the rows a mask
  leaves out reads the mask's values, which a fake tensor has none of;
* the Python bindings of ``Tensor.__getitem__`` / ``__setitem__`` / ``copy_`` /
  ``contiguous`` are replaced by the ATen calls they make (their device guard raises),
  and ``addmm(.., out=)`` takes its meta kernel (its Python decomposition copies through
  ``Tensor.copy_``).
"""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys

import pytest
import torch

from fx_passes.kernels import tiling
from tests import fake_cuda_loops
from tests.helpers import clean_env, last_json

ROOT = pathlib.Path(__file__).resolve().parent.parent
CUDA = ["cuda:0"]
# (path, what the rewrite emits) that a CPU-only torch runs through
RUNS = {
    "given_logits_stats": "fx_passes.kernels.log_softmax.given.row_stats",
    "given_logits_stats_dynamic": "fx_passes.kernels.log_softmax.given.row_stats",
    # ("auto" on a GPU keeps a log-prob's logits, tiling.keeps_logits; "gpu" recomputes them;
    # a cross-entropy alone keeps its own loop: here the one that leaves ignored rows out)
    "lm_head_per_token": "fx_passes.kernels.log_softmax.lm_head_kept.lm_head_row_stats_kept",
    "lm_head_per_token_recompute": "fx_passes.kernels.log_softmax.lm_head.lm_head_row_stats",
    "lm_head_ce_per_token": "fx_passes.kernels.log_softmax.lm_head_masked.lm_head_row_stats_masked",
    # (every row run: the recomputing loop, no logits kept)
    "lm_head_ce_per_token_every_row": "fx_passes.kernels.log_softmax.lm_head.lm_head_row_stats",
    # (its op's count of rows run is a host tensor: inside the call, not among its results)
    "lm_head_per_token_masked": "fx_passes.kernels.log_softmax.lm_head_masked.lm_head_row_stats_masked",
    "row_local_given_logits": "fx_passes.kernels.row_local.engine.row_local",
    "row_local_given_logits_symbolic_scalar": "fx_passes.kernels.row_local.engine.row_local",
    "row_local_lm_head_sweeps": "fx_passes.kernels.row_local.sweeps.row_local_sweeps",
    # (a masked KL whose per-row results the graph keeps: not the masked op, NOTE [row-local
    # rows a mask leaves unread])
    "row_local_lm_head_sweeps_masked": "fx_passes.kernels.row_local.sweeps.row_local_sweeps",
}
# the paths whose rewrite traces on real tensors of the device (see the docstring)
TRACED_ON_THE_DEVICE = {"row_local_lm_head_loss"}


@pytest.fixture(scope="module")
def result() -> dict:
    if torch.backends.cuda.is_built():  # (a CUDA build initialises its driver for a device tensor)
        pytest.skip("fake CUDA tensors model a CPU-only torch; with a CUDA build, tests/test_gpu.py runs "
                    "the paths on a GPU (benchmarks/gpu_check.py)")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fake_cuda_child.py")], cwd=ROOT,
                          env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = last_json(proc.stdout)
    for kind in ("as_built", "gpu_kernels"):
        assert set(got[kind]["paths"]) == {*RUNS, *TRACED_ON_THE_DEVICE, "lm_head_loss_in_graph",
                                           "lm_head_loss_in_graph_recompute"}
    return got


@pytest.mark.slow  # (the module's fresh process, tests/fake_cuda_child.py, runs in its fixture)
def test_the_plan_a_cuda_device_gets(result):
    """Without ``mm.dtype`` for CUDA (this build), "auto" and a forced "gpu" run
    "blocks"; with it, "auto" is "gpu" (never a CPU plan on a GPU)."""
    assert result["as_built"]["plans"] == {"auto": "blocks", "gpu": "blocks", "blocks": "blocks",
                                           "kept_logits": "blocks"}  # (the loops that keep no logits)
    assert result["gpu_kernels"]["plans"] == {"auto": "gpu", "gpu": "gpu", "blocks": "blocks",
                                              "kept_logits": "gpu"}


@pytest.mark.parametrize("kind", ["as_built", "gpu_kernels"])
@pytest.mark.parametrize("path", list(RUNS))
def test_every_tensor_on_the_cuda_device(result, kind, path):
    got = result[kind]["paths"][path]
    assert got["emitted"] == [RUNS[path]] and not got["unchanged"], got
    assert got["value_devices"] == CUDA, got  # (a constant made without a device would be "cpu")
    assert all(d.startswith("cuda") for d in got["factory_devices"].values()), got
    if path.endswith("symbolic_scalar"):  # (the temperature, a 0-d tensor the call takes)
        assert [k.split(":")[1] for k in got["factory_devices"]] == ["scalar_tensor"], got
    if path.startswith("row_local_given_logits"):  # (its fake kernel runs the region's body: refused here)
        assert got["refused"] == [RUNS[path]] and got["output_devices"] == [], got
    else:
        assert got["refused"] == [] and got["output_devices"] == CUDA and got["fake_outputs"], got


@pytest.mark.parametrize("kind", ["as_built", "gpu_kernels"])
def test_the_count_of_rows_run_is_a_host_tensor(result, kind):
    """The per-token call that leaves masked rows out hands its backward the count of rows
    run in host memory (one device read a step, in the forward; NOTE [per-token rows a
    mask leaves out]); every other tensor is on the device."""
    masked = ("lm_head_per_token_masked", "lm_head_ce_per_token")  # (a mask; the ignored labels)
    for name in masked:
        got = result[kind]["paths"][name]
        assert got["counters"].get("masked_rows") == 1 and got["count_devices"] == ["cpu"], got
    assert all(p["count_devices"] == [] for name, p in result[kind]["paths"].items()
               if name not in masked), result[kind]


@pytest.mark.parametrize("kind", ["as_built", "gpu_kernels"])
def test_a_row_local_region_keeping_masked_results_runs_every_row_and_says_why(result, kind):
    """On a GPU its backward would read the skipped rows' cotangents and the count from the
    device: the rewrite keeps ``row_local_sweeps`` (asserted above) and counts the near miss."""
    got = result[kind]["paths"]["row_local_lm_head_sweeps_masked"]
    assert got["counters"].get("masked_rows_not_skipped") == 1 and "masked_rows" not in got["counters"], got


def test_lm_head_loss_in_graph(result):
    """The loss in the graph, a log-prob's: "auto" keeps it in the graph on the call that
    keeps its logits (``tiling.keeps_logits``: stock keeps an FP32 ``[T, V]`` there), with
    or without ``mm.dtype``.  Forced "gpu" recomputes: without ``mm.dtype`` that runs
    "blocks", which computes no gradient in the forward (the per-row stats call); with it
    the loss tail, whose rewrite traces on the device (left as is here, the user's graph
    compiled unchanged)."""
    for kind in ("as_built", "gpu_kernels"):
        kept = result[kind]["paths"]["lm_head_loss_in_graph"]
        assert kept["emitted"] == [RUNS["lm_head_per_token"]] and kept["counters"]["kept_logits"] == 1, kept
        assert kept["value_devices"] == CUDA and kept["output_devices"] == CUDA, kept
    blocks = result["as_built"]["paths"]["lm_head_loss_in_graph_recompute"]
    assert blocks["emitted"] == ["fx_passes.kernels.log_softmax.lm_head.lm_head_row_stats"], blocks
    assert blocks["value_devices"] == CUDA and blocks["output_devices"] == CUDA, blocks
    gpu = result["gpu_kernels"]["paths"]["lm_head_loss_in_graph_recompute"]
    assert gpu["unchanged"] and gpu["failed_for_no_cuda"] and gpu["counters"] == {"pass_failed": 1}, gpu


@pytest.mark.parametrize("kind", ["as_built", "gpu_kernels"])
def test_traced_on_the_device_leaves_the_graph(result, kind):
    for path in TRACED_ON_THE_DEVICE:
        got = result[kind]["paths"][path]
        assert got["unchanged"] and got["failed_for_no_cuda"], (path, got)


# ---- the "gpu" plan's chunk loops at the recorded run's sizes (issue 54, item 2) ----------------
# tests/fake_cuda_loops.py runs them on fake CUDA tensors (T 8192, V 151936, H 4096, bf16) with
# the budget of an 80 GB and a 141 GB device and records every ATen call in order; its
# docstring says what differs from a GPU (the chunk bodies run eagerly: a body's logits GEMM
# is ``aten.linear``, Inductor's extern ``mm`` on a GPU; the loss loop calls ``mm`` itself).
T, V, H = 8192, 151936, 4096
BF16, F32 = "bfloat16", "float32"
DEVICES = ("h100", "h200")
OUT_DTYPE_GEMMS = ("aten.mm.dtype_out", "aten.addmm.dtype_out")


def _gemms(ops) -> list:
    return [(o["op"], tuple(o["shape"]), o["dtype"]) for o in ops
            if o["op"] == "aten.linear.default" or o["op"].startswith(("aten.mm.", "aten.addmm."))]


def _on(storages, ops) -> list:
    """The calls that read or write one of ``storages`` (views of them left out: no kernel)."""
    return [(o["op"], tuple(o["shape"]), o["dtype"]) for o in ops if set(storages) & set(o["storages"])
            and not o["view"]]


def _from_the_gradient(ops, first: int, last: int) -> list[str]:
    """The calls (views left out) after the one that wrote the logits gradient that the
    GEMMs ``ops[first]`` and ``ops[last]`` both read, through ``ops[last]``: no cast or
    copy of it between its row kernel and its GEMMs, which read it in model precision.
    The loss loop's gradient is written over its chunk's logits (``loss.logits_grad_into``:
    one kernel compiled, tests/test_gpu_loss_chunks.py; eagerly here, rounded then copied
    over them), so the call that wrote it is the last before ``ops[first]`` to touch it."""
    shared = set(ops[first]["storages"]) & set(ops[last]["storages"])
    assert len(shared) == 1, (ops[first], ops[last])  # (one gradient, not a copy of it for one GEMM)
    made = max(i for i, o in enumerate(ops[:first]) if shared & set(o["storages"]) and not o["view"])
    over = ops[made]["op"] == "aten.copy_.default"  # (the eager body: written over the logits)
    rounded = next(o for o in reversed(ops[:made]) if not o["view"]) if over else ops[made]
    assert rounded["dtype"] == BF16 and F32 in rounded["in_dtypes"], ops[made]  # (rounded from FP32)
    assert not over or set(rounded["storages"]) & set(ops[made]["storages"]), (rounded, ops[made])
    return [o["op"] for o in ops[made + 1:last + 1] if not o["view"]]


def _loss_chunks(result, device) -> list[int]:
    """Rows of each chunk: the logits GEMMs' (``[rows, V]`` in model precision)."""
    fwd = result["loops"]["loss"][device]["forward"]
    return [s[0] for op, s, dt in _gemms(fwd) if op == "aten.mm.default" and s[1] == V and dt == BF16]


@pytest.mark.parametrize("device", DEVICES)
def test_the_loss_loop_runs_few_large_chunks(result, device):
    rows = _loss_chunks(result, device)
    assert rows == [T // 2] * 2, rows  # (tiling.MAX_LOSS_CHUNKS: the 2026-12-04 run had 4 of 2048)
    budget = result["loops"]["loss"][device]["budget"]
    assert budget == tiling.device_budget("cuda", fake_cuda_loops.DEVICES[device]) >= 1024 * 2**20
    assert rows == [b - a for a, b in tiling.even_splits(T, tiling.gpu_loss_rows(budget, T, V))]


def _loss_gemms(rows: list[int]) -> list[list[tuple]]:
    """Per chunk: the logits GEMM, ``grad_hidden[chunk]``'s and ``grad_weight``'s."""
    return [[("aten.mm.default", (r, V), BF16), ("aten.mm.dtype_out", (r, H), F32),
             ("aten.addmm.dtype_out" if i else "aten.mm.dtype_out", (V, H), F32)] for i, r in enumerate(rows)]


@pytest.mark.parametrize("device", DEVICES)
def test_each_loss_chunk_runs_its_gemms_into_the_fp32_sums(result, device):
    """Per chunk: the logits GEMM, ``grad_hidden[chunk]`` written by one ``out_dtype`` GEMM
    into its rows, ``grad_weight``'s FP32 sum written by the first chunk's GEMM (beta 0)
    and added to inside every later one (``addmm`` into the FP32 ``out``: the path of the
    CUDA probe's answer, not ``product_cols`` pieces); model-precision inputs only."""
    got = result["loops"]["loss"][device]
    fwd, rows, sums = got["forward"], _loss_chunks(result, device), got["sums"]
    assert _gemms(fwd) == sum(_loss_gemms(rows), [])
    gemms = [o for o in fwd if o["op"] in OUT_DTYPE_GEMMS]
    assert all(o["in_dtypes"] in ([BF16, BF16], [F32, BF16, BF16]) for o in gemms)  # (addmm's self: the sum)
    assert [o["writes"] for o in gemms] == [sums["grad_hidden"], sums["grad_weight"]] * len(rows)
    starts = [sum(rows[:i]) * H for i in range(len(rows))]  # each chunk's rows of grad_hidden, once
    assert [o["offset"] for o in gemms if o["writes"] == sums["grad_hidden"]] == starts


@pytest.mark.parametrize("device", DEVICES)
def test_nothing_but_the_gemms_touches_the_fp32_sums(result, device):
    """The sums are allocated (not filled), and in the forward no call but their GEMMs
    reads or writes them (no fill, zero, copy, add or cast); each chunk's logits gradient
    goes from its row kernel to its two GEMMs with nothing between."""
    got = result["loops"]["loss"][device]
    fwd, chunks, sums = got["forward"], _loss_gemms(_loss_chunks(result, device)), got["sums"]
    allocated = [("aten.new_empty.default", (T, H), F32), ("aten.new_empty.default", (V, H), F32)]
    assert _on(sums.values(), fwd) == allocated + [g for c in chunks for g in c[1:]]
    on_h, on_w = ([i for i, o in enumerate(fwd) if o["writes"] == sums[name]] for name in sums)
    assert [_from_the_gradient(fwd, i, j) for i, j in zip(on_h, on_w)] == [[c[1][0], c[2][0]] for c in chunks]


@pytest.mark.parametrize("device", DEVICES)
def test_the_loss_backward_rounds_each_fp32_sum_once(result, device):
    """The backward (``loss._backward``): each sum read once, times the incoming gradient,
    and rounded to model precision once (one kernel each under Inductor)."""
    got = result["loops"]["loss"][device]
    bwd = got["backward"]
    assert [(o["op"], tuple(o["shape"]), o["dtype"]) for o in bwd] == [
        ("aten.mul.Tensor", (T, H), F32), ("aten._to_copy.default", (T, H), BF16),
        ("aten.mul.Tensor", (V, H), F32), ("aten._to_copy.default", (V, H), BF16)]
    assert [set(got["sums"].values()) & set(o["storages"]) for o in bwd[0::2]] == [
        {got["sums"]["grad_hidden"]}, {got["sums"]["grad_weight"]}]


def test_where_addmm_cannot_write_an_fp32_out_later_chunks_add_products(result):
    """torch 2.8's CUDA ``addmm`` (``compat.probe_addmm_into`` says no): each later chunk
    adds FP32 products of at most ``product_cols`` columns into the sum, a separate add
    each, which the test above finds wherever it appears."""
    got = result["loops"]["loss_addmm_2_8"]
    rows = _loss_chunks(result, "h200")
    pieces = tiling.even_splits(V, tiling.product_cols(got["budget"], V, H))
    on_weight = _on([got["sums"]["grad_weight"]], got["forward"])
    adds = [(b - a, H) for a, b in pieces] * (len(rows) - 1)
    assert [s for op, s, _ in on_weight if op == "aten.add_.Tensor"] == adds
    assert [op for op, _, _ in on_weight] == ["aten.new_empty.default", "aten.mm.dtype_out"] + [
        "aten.add_.Tensor"] * len(adds)


@pytest.mark.parametrize("device", DEVICES)
def test_per_token_blocks_write_then_add_the_fp32_grad_hidden(result, device):
    """The per-token backward (``gpu_plan.out_dtype_blocks``): per vocabulary block the
    logits recomputed over all rows, ``grad_weight[block]`` one model-precision GEMM
    over all rows written into its rows, ``grad_hidden``'s FP32 sum written by the first
    block's ``out_dtype`` GEMM and added to inside every later one; one downcast at the
    end, no zero-fill."""
    got = result["loops"]["per_token"][device]
    ops, budget = got["ops"], got["budget"]
    assert tiling.accumulator_rows(budget, T, H) == T  # one sweep: all rows' sum held
    cols = [b - a for a, b in tiling.even_splits(V, tiling.gpu_block_cols(budget, T, V))]
    # even blocks of V / 4 (the 2026-12-04 run's code: 5 of 30464, rounding the budget's columns down)
    assert cols == [38016] * 3 + [37888]
    assert _gemms(ops) == sum(([("aten.linear.default", (T, c), BF16), ("aten.mm.out", (c, H), BF16),
                                ("aten.addmm.dtype_out" if i else "aten.mm.dtype_out", (T, H), F32)]
                               for i, c in enumerate(cols)), [])
    (acc,) = {o["writes"] for o in ops if o["op"] in OUT_DTYPE_GEMMS}
    assert _on([acc], ops) == [("aten.empty.memory_format", (T, H), F32), ("aten.mm.dtype_out", (T, H), F32),
                               *[("aten.addmm.dtype_out", (T, H), F32)] * (len(cols) - 1),
                               ("aten.copy_.default", (T, H), BF16)]  # (the downcast into grad_hidden)
    on_w = [i for i, o in enumerate(ops) if o["op"] == "aten.mm.out"]
    assert [ops[i]["writes"] for i in on_w] == [got["grads"]["grad_weight"]] * len(cols)
    on_acc = [i for i, o in enumerate(ops) if o["writes"] == acc]
    assert [_from_the_gradient(ops, i, j) for i, j in zip(on_w, on_acc)] == [
        ["aten.mm.out", "aten.addmm.dtype_out" if k else "aten.mm.dtype_out"] for k in range(len(cols))]
    assert _on([got["grads"]["grad_hidden"]], ops) == [("aten.empty_like.default", (T, H), BF16),
                                                        ("aten.copy_.default", (T, H), BF16)]


@pytest.mark.parametrize("device", DEVICES)
def test_the_kept_logits_forward_writes_them_in_one_gemm(result, device):
    """``"kept_logits"``' forward (``lm_head_kept._fill``, NOTE [kept logits]) with the
    device's budget: one chunk of every row (``tiling.kept_rows``), its GEMM writing the kept
    buffer itself (``out=``: stock's GEMM), nothing copied into it; with a soft cap (whose
    tanh Inductor keeps in an FP32 tile) the budget's chunks, each GEMM into its rows."""
    got = result["loops"]["kept_forward"][device]
    assert _gemms(got["ops"]) == [("aten.mm.out", (T, V), BF16)]
    [mm] = [o for o in got["ops"] if o["op"] == "aten.mm.out"]
    assert mm["writes"] == got["logits"] and mm["offset"] == 0
    assert not [o for o in got["ops"] if o["op"] == "aten.copy_.default" and got["logits"] in o["storages"]]
    capped = result["loops"]["kept_forward_softcap"]
    rows = [b - a for a, b in tiling.even_splits(T, tiling.forward_rows(capped["budget"], T, V))]
    mms = [o for o in capped["ops"] if o["op"] == "aten.mm.out"]
    assert len(rows) > 1 and [tuple(o["shape"]) for o in mms] == [(r, V) for r in rows]
    assert all(o["writes"] == capped["logits"] for o in mms)
    assert [o["offset"] for o in mms] == [a * V for a, _ in tiling.even_splits(T, max(rows))]


@pytest.mark.parametrize("device", DEVICES)
def test_the_kept_logits_backward_writes_over_them_then_runs_two_gemms(result, device):
    """``lm_head_plan="kept_logits"`` (``lm_head_kept.kept_grads``, NOTE [kept logits]): no
    logits GEMM; the gradient written over the kept logits in one chunk of every row (the
    device's budget: ``tiling.kept_rows``; eagerly here: rounded, then copied over them),
    then ``grad_hidden`` and ``grad_weight`` one model-precision GEMM each over all rows,
    from the logits' own buffer; no FP32 sum."""
    got = result["loops"]["kept"][device]
    ops = got["ops"]
    assert _gemms(ops) == [("aten.mm.default", (T, H), BF16), ("aten.mm.default", (V, H), BF16)]
    assert tiling.kept_rows(got["budget"], T, V, "cuda") == T
    over = [o for o in ops if o["op"] == "aten.copy_.default" and got["logits"] in o["storages"]]
    assert [tuple(o["shape"]) for o in over] == [(T, V)]  # (the gradient in place, one chunk)
    gemms = [o for o in ops if o["op"] == "aten.mm.default"]
    assert all(got["logits"] in o["storages"] for o in gemms)  # (the gradient where the logits were)
    # no FP32 [T, H] or [V, H] sum; the eager body's FP32 temporaries are of its one chunk (under
    # Inductor none: one kernel that writes the gradient over the logits, tests/test_gpu_loss_chunks.py)
    fp32 = {tuple(o["shape"]) for o in ops if o["dtype"] == F32}
    assert not fp32 & {(T, H), (V, H)} and max(map(len, fp32)) <= 2
    assert max(math.prod(shape) for shape in fp32) == T * V
