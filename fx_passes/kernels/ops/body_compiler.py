"""The one way a chunk body is compiled: every per-chunk function the run-time loops call
(the lm_head loop's bodies, :mod:`fx_passes.kernels.log_softmax.bodies`; the vocab-parallel stage
bodies and their vector-Jacobian products, :mod:`fx_passes.kernels.ops.user_bodies`).

Stock Inductor compiles each body once (``dynamic=True``, ``fullgraph=True``, no pre-grad
passes); a body that fails to compile or run runs eagerly from then on (logged once,
counted), so a compile failure never ends a training step.  :func:`use_user_options`
carries the user's Inductor settings; :func:`compiling_with` is the seam for tests.
See NOTE [body compiles].
"""

# NOTE [body compiles]
# * Inductor compiles the body once (``dynamic=True``, ``fullgraph=True``): fused kernels
#   that read model-precision tensors, so no FP32 ``[.., V]`` buffer exists.  It is stock
#   Inductor whatever the process installed: no ``pre_grad_custom_pass`` runs on a body
#   (:func:`fx_passes.install` puts the passes there, and a body must not be rewritten
#   by the pass that made it; a user's own pre-grad pass is for the user's graphs).
# * Each call passes detached tensors under one dispatch-key set and grad mode
#   (``compat.below_autograd_no_grad``), since Dynamo guards on all three and the loops'
#   first call and later ones can differ: each body compiles once.
# * The user's saved-tensor hooks are set aside during the call
#   (``compat.without_saved_tensors_hooks``): they are for what the user's graph saves,
#   and ``torch.func.vjp`` refuses to run under them.
# * The fall-back policy: if compiling (or running the compiled body) raises, the body
#   runs eagerly from then on (the same maths, with FP32 temporaries), said once in the log
#   and counted (``counter``); a compile failure inside a training step never ends it.
#   A body past Dynamo's recompile limit (``fullgraph=True`` makes Dynamo raise there
#   instead of running it eagerly unseen) is such a failure, named in the log and also
#   counted as ``body_recompile_limit``.
# * Never compiled inside a CUDA graph capture: a body whose first call comes while the
#   current stream captures runs eagerly for that call (counted ``body_in_capture_eager``,
#   said once); it compiles at its first call outside a capture.
# * The user's Inductor settings (``torch.compile(..., backend="chunked_logits", mode=,
#   options={"inductor": ...})``, :func:`use_user_options`) apply to the bodies made after
#   that compile, but for CUDA graphs (a body runs inside an op of the user's graph), the
#   user's custom passes and cacheable marks (for the user's graphs); a body's own settings win.
#
# The seam for tests and debugging is :func:`compiling_with`: within it, bodies are made by
# the given function instead of ``torch.compile`` (e.g. ``lambda fn, options: fn`` runs
# them eagerly), and are cached apart from the compiled ones.

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator, Optional

import torch
from torch._dynamo.utils import counters

from ... import compat
from ...reporting.report import COUNTER, log

__all__ = ["compile_body", "compiling_with", "use_user_options", "user_options"]

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
_user: dict[str, Any] = {}  # the user's Inductor settings that bodies take (use_user_options)


def _for_bodies(key: str) -> bool:
    """Does the user's Inductor setting ``key`` apply to a body? Not CUDA graphs, custom
    passes or cacheable marks (see the module's docstring)."""
    return not ("cudagraph" in key or "custom" in key or key == "unsafe_marked_cacheable_functions")


def use_user_options(options: Optional[dict]) -> None:
    """Bodies made from now on compile with the user's Inductor settings ``options``
    (those :func:`_for_bodies` keeps); called by the ``chunked_logits`` backend."""
    _user.clear()
    _user.update({k: v for k, v in (options or {}).items() if _for_bodies(k)})


def user_options() -> dict[str, Any]:
    """The user's Inductor settings that bodies made now take."""
    return dict(_user)


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


def _recompile_limit(error: Exception) -> bool:
    """Did compiling a body stop at Dynamo's recompile limit?"""
    limit_hit = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None)
    return (limit_hit is not None and isinstance(error, limit_hit)) or "recompile limit" in str(error)


def _fallback(compiled: Callable, eager: Callable, what: str, counter: str) -> Callable:
    state = {"fn": compiled, "warm": False, "said": False}

    def call(*args):
        if state["fn"] is compiled:
            if not state["warm"] and compat._capturing("cuda"):
                counters[COUNTER]["body_in_capture_eager"] += 1
                if not state["said"]:
                    state["said"] = True
                    log.warning("chunked_logits: the chunk body %s was first called inside a CUDA graph "
                                "capture; it runs eagerly there (same results, FP32 temporaries) and "
                                "compiles at its first call outside a capture", what)
                return eager(*args)
            try:
                out = compiled(*args)
                state["warm"] = True
                return out
            except Exception as e:  # noqa: BLE001 - any compile failure: fall back, say so
                if _recompile_limit(e):
                    counters[COUNTER]["body_recompile_limit"] += 1
                    log.warning("chunked_logits: the chunk body %s reached Dynamo's recompile limit "
                                "(torch._dynamo.config.recompile_limit = %s); it runs eagerly from now on "
                                "(same results, FP32 temporaries)", what,
                                getattr(torch._dynamo.config, "recompile_limit", "?"))
                else:
                    log.warning("chunked_logits: compiling the chunk body %s failed; it runs eagerly from "
                                "now on (same results, FP32 temporaries)", what, exc_info=True)
                counters[COUNTER][counter] += 1
                state["fn"] = eager
        return state["fn"](*args)
    return call


def _detached(value: Any) -> Any:
    """``value`` with each tensor detached, inside tuples (named ones too)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        items = [_detached(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def compile_body(key: Any, fn: Callable, name: str, counter: str, options: Optional[dict] = None,
                 grad_mode: Callable[[], Any] = compat.below_autograd_no_grad) -> Callable:
    """``fn`` compiled once per ``key`` and user settings (with the active compiler, the
    user's Inductor settings under ``options``), called with detached tensors under
    ``grad_mode``; ``name`` names its code object and the log line, ``counter`` counts an
    eager fall-back."""
    compiler = _compiler[-1]
    cache_key = (id(compiler), key, repr(sorted(_user.items())) if _user else "")
    if cache_key not in _cache:
        settings = {**_user, **(options or {})} or None
        run = _fallback(compiler(_own_code(fn, name), settings), fn, name, counter)

        def call(*args):
            args = _detached(args)
            with grad_mode(), compat.without_saved_tensors_hooks():
                return run(*args)
        _cache[cache_key] = call
    return _cache[cache_key]
