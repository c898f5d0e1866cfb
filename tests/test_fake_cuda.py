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
(benchmarks/gpu_check.py) covers the rest on a GPU.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from tests.helpers import clean_env, last_json

ROOT = pathlib.Path(__file__).resolve().parent.parent
CUDA = ["cuda:0"]
# (path, what the rewrite emits) that a CPU-only torch runs through
RUNS = {
    "given_logits_stats": "fx_passes.kernels.log_softmax.given.row_stats",
    "given_logits_stats_dynamic": "fx_passes.kernels.log_softmax.given.row_stats",
    "lm_head_per_token": "fx_passes.kernels.log_softmax.lm_head.lm_head_row_stats",
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
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fake_cuda_child.py")], cwd=ROOT,
                          env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = last_json(proc.stdout)
    for kind in ("as_built", "gpu_kernels"):
        assert set(got[kind]["paths"]) == {*RUNS, *TRACED_ON_THE_DEVICE, "lm_head_loss_in_graph"}
    return got


@pytest.mark.slow  # (the module's fresh process, tests/fake_cuda_child.py, runs in its fixture)
def test_the_plan_a_cuda_device_gets(result):
    """Without ``mm.dtype`` for CUDA (this build), "auto" and a forced "gpu" run
    "blocks"; with it, "auto" is "gpu" (never a CPU plan on a GPU)."""
    assert result["as_built"]["plans"] == {"auto": "blocks", "gpu": "blocks", "blocks": "blocks"}
    assert result["gpu_kernels"]["plans"] == {"auto": "gpu", "gpu": "gpu", "blocks": "blocks"}


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
    got = result[kind]["paths"]["lm_head_per_token_masked"]
    assert got["counters"].get("masked_rows") == 1 and got["count_devices"] == ["cpu"], got
    assert all(p["count_devices"] == [] for name, p in result[kind]["paths"].items()
               if name != "lm_head_per_token_masked"), result[kind]


@pytest.mark.parametrize("kind", ["as_built", "gpu_kernels"])
def test_a_row_local_region_keeping_masked_results_runs_every_row_and_says_why(result, kind):
    """On a GPU its backward would read the skipped rows' cotangents and the count from the
    device: the rewrite keeps ``row_local_sweeps`` (asserted above) and counts the near miss."""
    got = result[kind]["paths"]["row_local_lm_head_sweeps_masked"]
    assert got["counters"].get("masked_rows_not_skipped") == 1 and "masked_rows" not in got["counters"], got


def test_lm_head_loss_in_graph(result):
    """The loss in the graph: "blocks" computes no gradient in the forward (the per-row
    stats call); "gpu" takes the loss tail, whose rewrite traces on the device (left as
    is here, the user's graph compiled unchanged)."""
    blocks = result["as_built"]["paths"]["lm_head_loss_in_graph"]
    assert blocks["emitted"] == ["fx_passes.kernels.log_softmax.lm_head.lm_head_row_stats"], blocks
    assert blocks["value_devices"] == CUDA and blocks["output_devices"] == CUDA, blocks
    gpu = result["gpu_kernels"]["paths"]["lm_head_loss_in_graph"]
    assert gpu["unchanged"] and gpu["failed_for_no_cuda"] and gpu["counters"] == {"pass_failed": 1}, gpu


@pytest.mark.parametrize("kind", ["as_built", "gpu_kernels"])
def test_traced_on_the_device_leaves_the_graph(result, kind):
    for path in TRACED_ON_THE_DEVICE:
        got = result[kind]["paths"][path]
        assert got["unchanged"] and got["failed_for_no_cuda"], (path, got)
