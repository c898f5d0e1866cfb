"""The one way a chunk body is compiled: every per-chunk function the run-time loops call
(the lm_head loop's bodies, :mod:`fx_passes.kernels.bodies`; the vocab-parallel stage
bodies and their vector-Jacobian products, :mod:`fx_passes.kernels.graph_bodies`).

* Inductor compiles the body once (``dynamic=True``, ``fullgraph=True``): fused kernels
  that read model-precision tensors, so no FP32 ``[.., V]`` buffer exists.  It is stock
  Inductor whatever the process installed: no ``pre_grad_custom_pass`` runs on a body
  (:func:`fx_passes.install` puts the passes there, and a body must not be rewritten
  by the pass that made it; a user's own pre-grad pass is for the user's graphs).
* Each call passes detached tensors under one dispatch-key set and grad mode
  (``compat.below_autograd_no_grad``), since Dynamo guards on all three and the loops'
  first call and later ones can differ: each body compiles once.
* The user's saved-tensor hooks are set aside during the call
  (``compat.without_saved_tensors_hooks``): they are for what the user's graph saves,
  and ``torch.func.vjp`` refuses to run under them.
* The fall-back policy: if compiling (or running the compiled body) raises, the body
  runs eagerly from then on (the same maths, with FP32 temporaries), said once in the log
  and counted (``counter``); a compile failure inside a training step never ends it.

The seam for tests and debugging is :func:`compiling_with`: within it, bodies are made by
the given function instead of ``torch.compile`` (e.g. ``lambda fn, options: fn`` runs
them eagerly), and are cached apart from the compiled ones.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator, Optional

import torch
from torch._dynamo.utils import counters

from .. import compat
from ..reporting.report import COUNTER, log

__all__ = ["compile_body", "compiling_with"]

Compiler = Callable[[Callable, Optional[dict]], Callable]


def _stock_inductor(options: Optional[dict]) -> Callable:
    """A torch.compile backend: Inductor with ``options`` and no pre-grad custom pass."""
    patches = {**(options or {}), "pre_grad_custom_pass": None}

    def stock_inductor(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=patches)
    return stock_inductor


def _inductor(fn: Callable, options: Optional[dict]) -> Callable:
    return torch.compile(fn, backend=_stock_inductor(options), dynamic=True, fullgraph=True)


_compiler: list[Compiler] = [_inductor]
_cache: dict[Any, Callable] = {}


@contextlib.contextmanager
def compiling_with(compiler: Compiler) -> Iterator[None]:
    """Make bodies with ``compiler(fn, options)`` instead of Inductor, within the block."""
    _compiler.append(compiler)
    try:
        yield
    finally:
        _compiler.pop()


def _own_code(fn: Callable, name: str) -> Callable:
    """``fn`` with a code object of its own: Dynamo keeps compiled graphs and guards per
    code object, so each body gets its own cache (one closure shared by many bodies would
    recompile from one to the next and hit the recompile limit)."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__,
                              fn.__closure__)


def _fallback(compiled: Callable, eager: Callable, what: str, counter: str) -> Callable:
    state = {"fn": compiled}

    def call(*args):
        if state["fn"] is compiled:
            try:
                return compiled(*args)
            except Exception:  # noqa: BLE001 - any compile failure: fall back, say so
                log.warning("chunked_logits: compiling the chunk body %s failed; it runs eagerly from "
                            "now on (same results, FP32 temporaries)", what, exc_info=True)
                counters[COUNTER][counter] += 1
                state["fn"] = eager
        return state["fn"](*args)
    return call


def compile_body(key: Any, fn: Callable, name: str, counter: str, options: Optional[dict] = None,
                 grad_mode: Callable[[], Any] = compat.below_autograd_no_grad) -> Callable:
    """``fn`` compiled once per ``key`` (with the active compiler), called with detached
    tensors under ``grad_mode``; ``name`` names its code object and the log line,
    ``counter`` counts an eager fall-back."""
    compiler = _compiler[-1]
    cache_key = (id(compiler), key)
    if cache_key not in _cache:
        run = _fallback(compiler(_own_code(fn, name), options), fn, name, counter)

        def call(*args):
            args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
            with grad_mode(), compat.without_saved_tensors_hooks():
                return run(*args)
        _cache[cache_key] = call
    return _cache[cache_key]
