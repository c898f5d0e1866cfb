"""One setup factory per (workload, mode), shared by the memory, time and soak runs.

A *mode* is how the workload function runs: eagerly, under stock Inductor, under
Inductor with its AutoChunker, or under the ``chunked_logits`` backend (static or
``dynamic=True``); or, for a *peer* mode, another implementation of the same loss
(torch's ``F.linear_cross_entropy``, benchmarks/baselines.py), eager or compiled.  Each
mode compiles its own copy of the function (a fresh code object), so Dynamo keeps one
cache per mode and modes interleaved in one process never reuse each other's compiled
graphs.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import sys
import types
from typing import Callable

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import baselines  # noqa: E402
from fx_passes.testing.workloads import (  # noqa: E402, F401 (run.py reads WORKLOADS here)
    ALL_WORKLOADS,
    WORKLOADS,
    UpcastToFp64,
    Workload,
    ensure_backend,
    run_step,
)

__all__ = ["MODES", "STOCK", "default_modes", "Case", "make_case", "make_inputs", "compile_mode", "sizes",
           "limit_bytes", "reference", "errors", "pass_report", "snapshot"]

MODES = {
    "eager": "eager PyTorch, no compile",
    "inductor": 'torch.compile(backend="inductor")',
    "autochunk": "stock Inductor with auto_chunker.enable=True",
    "chunked_logits": 'torch.compile(backend="chunked_logits")',
    "chunked_logits_dyn": 'torch.compile(backend="chunked_logits", dynamic=True)',
    "chunked_logits_all_rows": 'torch.compile(backend="chunked_logits", options={"skip_masked_rows": False})',
    "chunked_logits_kept": 'torch.compile(backend="chunked_logits", options={"lm_head_plan": "kept_logits"})',
    "chunked_logits_up": 'torch.compile(backend="chunked_logits", options={"upgrade_low_precision": True})',
    "chunked_logits_up_dyn": "the same with dynamic=True",
    **baselines.PEERS,  # torch_lce, torch_lce_compiled: WV only
}
UPGRADE_OPTIONS = {"upgrade_low_precision": True}


def default_modes(name: str) -> list[str]:
    """The modes worth running for workload ``name``.

    The upgrade modes only differ from ``chunked_logits`` on graphs that never upcast
    (U1-U3), where the AutoChunker has no matmul to chunk; W1-W5 always upcast.
    """
    if ALL_WORKLOADS[name].upgrade:
        return ["eager", "inductor", "chunked_logits", "chunked_logits_up", "chunked_logits_up_dyn"]
    ours = [m for m in MODES if not m.startswith("chunked_logits_up") and m not in baselines.PEERS
            and m not in ("chunked_logits_all_rows", "chunked_logits_kept")]
    return ours + baselines.peers_for(name)


STOCK = "inductor"
# the lm_head matmul is in the graph
LM_HEAD_WORKLOADS = ("W4", "W4L", "W4C", "W4M", "W4E", "W4S", "WV", "WD", "WDM", "WDE")
LM_HEAD_HIDDEN = 1024  # H of W4 (workloads._make_lm_head's default)
LM_HEAD_CHUNK_ROWS = 256  # rows of the one FP32 logits chunk W4's limit allows


def _fresh(fn: Callable) -> Callable:
    """A copy of ``fn`` with its own code object, hence its own Dynamo cache."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


class _CantChunkReasons(logging.Handler):
    """Keeps the message of each ``CantChunk`` the AutoChunker logs (why it did not apply)."""

    reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.reasons.append(str(record.exc_info[1]).splitlines()[0][:200])


def _listen_to_auto_chunker() -> None:
    logger = torch._logging.getArtifactLogger("torch._inductor.fx_passes.joint_graph", "auto_chunker")
    if not any(isinstance(h, _CantChunkReasons) for h in logger.handlers):
        logger.setLevel(logging.DEBUG)  # the pass logs its reason at DEBUG, off by default
        logger.addHandler(_CantChunkReasons())


def _autochunk_backend(gm, example_inputs):
    """Stock Inductor with the AutoChunker on (it runs on the joint fwd+bwd graph).

    The caches are off for this compile so that a cache hit cannot skip the pass and
    hide whether it applied (``torch._inductor.metrics.num_auto_chunking``).
    """
    from torch._inductor.compile_fx import compile_fx
    _listen_to_auto_chunker()
    patches = {"auto_chunker.enable": True, "fx_graph_cache": False}
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, config_patches=patches)


def compile_mode(fn: Callable, mode: str) -> Callable:
    """``fn`` as it runs in ``mode`` (compiled lazily, on the first call)."""
    f = _fresh(fn)
    if mode in ("eager", "torch_lce"):
        return f
    if mode in ("inductor", "torch_lce_compiled"):
        return torch.compile(f, backend="inductor")
    if mode == "autochunk":
        return torch.compile(f, backend=_autochunk_backend)
    if mode == "chunked_logits":
        return torch.compile(f, backend="chunked_logits")
    if mode == "chunked_logits_dyn":
        return torch.compile(f, backend="chunked_logits", dynamic=True)
    if mode == "chunked_logits_all_rows":  # (every row computed, as before rows that count: issue 36)
        return torch.compile(f, backend="chunked_logits", options={"skip_masked_rows": False})
    if mode == "chunked_logits_kept":  # (three GEMMs, the logits kept: NOTE [kept logits])
        return torch.compile(f, backend="chunked_logits", options={"lm_head_plan": "kept_logits"})
    if mode == "chunked_logits_up":
        return torch.compile(f, backend="chunked_logits", options=UPGRADE_OPTIONS)
    if mode == "chunked_logits_up_dyn":
        return torch.compile(f, backend="chunked_logits", dynamic=True, options=UPGRADE_OPTIONS)
    raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")


def sizes(name: str, scale: int = 1, rows: int | None = None, vocab: int | None = None) -> tuple[int, int]:
    """(T, V) of workload ``name``: the issue's full size divided by ``scale``; ``rows``
    and ``vocab``, when given, replace T and V (before the division)."""
    T, V = ALL_WORKLOADS[name].full_size
    T, V = rows or T, vocab or V
    return max(T // scale, 1), max(V // scale, 2)


def make_inputs(name: str, T: int, V: int, seed: int = 0) -> tuple:
    return ALL_WORKLOADS[name].make(T, V, torch.bfloat16, seed)


@dataclasses.dataclass
class Case:
    """A workload, a mode, its compiled function and its inputs."""

    name: str
    mode: str
    T: int
    V: int
    workload: Workload
    fn: Callable
    inputs: tuple

    def step(self):
        """One step: (outputs, input gradients); see workloads.run_step."""
        return run_step(self.workload, self.fn, self.inputs)

    def clear_grads(self) -> None:
        for i in self.workload.grad_inputs:
            self.inputs[i].grad = None


def make_case(name: str, mode: str, T: int, V: int, inputs: tuple | None = None) -> Case:
    """The setup factory: pass ``inputs`` to share one set of inputs between modes.
    A peer mode runs its own function of the workload's inputs; the workload's stays
    the reference (its FP64 run gives the errors)."""
    w = ALL_WORKLOADS[name]
    inputs = make_inputs(name, T, V) if inputs is None else inputs
    fn = baselines.peer_fn(mode, name) if mode in baselines.PEERS else w.fn
    return Case(name, mode, T, V, w, compile_mode(fn, mode), inputs)


def limit_bytes(name: str, T: int, V: int) -> int:
    """The memory one step must allocate at least (the physical limit).

    Scoring (W1, W2, U1, U2): the FP32 [T] outputs.  W3, W5, WP, R1-R6, U3: the bf16
    logits gradient.  W4, W4L, WV (lm_head in the graph): bf16 grad of hidden and of weight,
    plus one FP32 chunk of 256 rows of logits; WD also a chunk of the teacher's.
    """
    if name in ("W1", "U1"):
        return 4 * T
    if name in ("W2", "U2"):
        return 2 * 4 * T
    if name in LM_HEAD_WORKLOADS:
        H = LM_HEAD_HIDDEN
        chunks = 2 if name in ("WD", "WDM", "WDE") else 1  # (the teacher's logits chunk too)
        return 2 * T * H + 2 * V * H + chunks * 4 * min(T, LM_HEAD_CHUNK_ROWS) * V
    return 2 * T * V


def reference(case: Case):
    """(outputs, grads) of the workload computed eagerly in FP64 from the same inputs."""
    def fp64(x):
        if not x.is_floating_point():
            return x
        return x.detach().double().requires_grad_(x.requires_grad)
    inputs = tuple(fp64(x) for x in case.inputs)
    with UpcastToFp64():
        return run_step(case.workload, case.workload.fn, inputs)


def _max_abs(got, want) -> float:
    if not got:
        return float("nan")
    return max((g.double() - w).abs().max().item() for g, w in zip(got, want))


def errors(case: Case, outputs, grads, ref=None) -> dict:
    """Max abs error of the outputs and of the input gradients vs the FP64 reference
    (``ref``, from :func:`reference`, when several modes share one set of inputs)."""
    ref_out, ref_grads = reference(case) if ref is None else ref
    scale = max((g.abs().max().item() for g in ref_grads), default=float("nan"))
    return {"out_err": _max_abs(outputs, ref_out), "grad_err": _max_abs(grads, ref_grads),
            "grad_ref_max": scale}


def _compile_counts() -> dict:
    from torch._dynamo.utils import counters
    from torch._inductor import metrics
    return {"unique_graphs": counters["stats"].get("unique_graphs", 0),
            "chunked_logits": dict(counters["chunked_logits"]),
            "auto_chunked_graphs": metrics.num_auto_chunking,
            "auto_chunker_declined": list(_CantChunkReasons.reasons)}


def pass_report(mode: str, since: dict | None = None) -> dict:
    """What the compiles did since the ``since`` snapshot (default: process start).

    Our rewrite counters for chunked_logits modes, AutoChunker applications for the
    autochunk mode, and the number of graphs Dynamo compiled.
    """
    now, before = _compile_counts(), since or {}
    old = before.get("chunked_logits", {})
    report = {"unique_graphs": now["unique_graphs"] - before.get("unique_graphs", 0)}
    if mode.startswith("chunked_logits"):
        report["chunked_logits"] = {k: v - old.get(k, 0) for k, v in now["chunked_logits"].items()
                                    if v - old.get(k, 0)}
    if mode == "autochunk":
        report["auto_chunked_graphs"] = now["auto_chunked_graphs"] - before.get("auto_chunked_graphs", 0)
        seen = len(before.get("auto_chunker_declined", []))
        report["auto_chunker_declined"] = "; ".join(now["auto_chunker_declined"][seen:])
    return report


snapshot = _compile_counts

