"""The ``chunked_logits`` torch.compile backend: stock Inductor plus our passes."""

from __future__ import annotations

import inspect
import types
from typing import Any, Mapping, Optional

import torch
from torch._dynamo import exc as dynamo_exc
from torch.fx import GraphModule

from .. import compat, env
from ..config import Config
from ..kernels.ops import body_compiler
from ..pipeline import transform, with_cacheable_marks
from ..reporting.containment import contained
from ..reporting.report import note_graph
from .install import backend_compiling

__all__ = ["chunked_logits", "settings", "OptionError"]

# The errors Dynamo passes through from a backend unwrapped (torch 2.11-2.14 have it).
_PASSED_THROUGH = tuple(c for c in [getattr(dynamo_exc, "ShortenTraceback", None)] if c is not None)


def _cacheable(patches: Optional[dict]) -> dict:
    """``patches`` plus the marks that let AOTAutograd's cache store a rewritten graph."""
    patches = dict(patches or {})
    if compat.CACHEABLE_MARKS:
        key = "unsafe_marked_cacheable_functions"
        patches[key] = with_cacheable_marks(patches.get(key, getattr(torch._inductor.config, key)))
    return patches


class OptionError(ValueError, *_PASSED_THROUGH):
    """A bad option of the backend, said as a plain ValueError at the user's call.

    ``torch.compile(fn, backend="chunked_logits", options=...)`` only looks the backend up
    (``lookup_backend``); Dynamo first calls it, with the options, when the compiled
    function is first called: that is the earliest a backend can see them.  Dynamo wraps
    what a backend raises in ``BackendCompilerFailed`` (with PyTorch's "report a bug"
    footer), except its own ``ShortenTraceback`` errors, which it passes through; so this
    ValueError is one of those too (where torch has them), its traceback starts at this
    backend, and its text is only ours (Dynamo appends its footer to ``args``).
    """

    def __init__(self, message: str, frame: Optional[types.FrameType] = None) -> None:
        ValueError.__init__(self, message)
        self.message = message
        self.first_useful_frame = frame  # where Dynamo's remove_dynamo_frames starts the traceback

    def __str__(self) -> str:
        return self.message


def settings(options: Optional[Mapping[str, Any]], mode: Optional[str] = None) -> tuple[Config, dict]:
    """The Config and the Inductor settings of ``options`` and ``mode``; a ValueError
    naming the option when one is wrong."""
    import torch._inductor.config as inductor_config

    if options is not None and not isinstance(options, Mapping):
        raise ValueError(
            f"chunked_logits: options must be a dict of option names to values, got "
            f"{type(options).__name__} {options!r}; e.g. options={{'strict': True}}"
        )
    options = dict(options or {})
    inductor_options = options.pop("inductor", None) or {}
    if not isinstance(inductor_options, Mapping):
        raise ValueError(
            f"chunked_logits: options['inductor'] must be a dict of Inductor settings, got "
            f"{type(inductor_options).__name__} {inductor_options!r}; for an Inductor mode "
            f"use torch.compile(..., mode={inductor_options!r}) or e.g. "
            f"options={{'inductor': {{'max_autotune': True}}}}"
        )
    inductor_options = dict(inductor_options)
    config = Config.from_options(options)
    unknown = [k for k in inductor_options if not isinstance(k, str) or not hasattr(inductor_config, k)]
    if unknown:  # the user's error, said before the pass (no pass_failed)
        raise ValueError(f"chunked_logits: unknown Inductor setting options['inductor'][{unknown[0]!r}]: "
                         f"torch._inductor.config.{unknown[0]} does not exist")
    if mode is not None:
        try:
            inductor_options = {**torch._inductor.list_mode_options(mode), **inductor_options}
        except RuntimeError as e:
            raise ValueError(f"chunked_logits: mode={mode!r}: {e}") from None
    return config, inductor_options


def chunked_logits(
    gm: GraphModule,
    example_inputs: list[Any],
    options: Optional[Mapping[str, Any]] = None,
    mode: Optional[str] = None,
):
    """``torch.compile(fn, backend="chunked_logits", options={...})``.

    ``options`` are :class:`~fx_passes.config.Config` fields; Inductor's own settings
    go under the key ``"inductor"``.  ``mode`` is Inductor's (e.g. "max-autotune").
    A wrong one is an :class:`OptionError` (a ValueError naming it) at the first call of
    the compiled function, before anything is compiled.

    A user's own Inductor custom passes (``pre_grad_custom_pass``, the joint and
    post-grad ones, set globally or under ``options["inductor"]``) run as with stock
    Inductor, after this backend's rewrite; a pass put in by :func:`fx_passes.install`
    leaves the graphs this backend compiles alone (each region is rewritten once).
    """
    from torch._inductor.compile_fx import compile_fx

    try:
        config, inductor_options = settings(options, mode)
    except ValueError as e:
        raise OptionError(str(e), inspect.currentframe()) from None
    if not env.disabled():  # (before the snapshot below: NOTE [a restarted compile])
        note_graph()
    # Created before the transform: if Inductor fails on the rewritten graph, the
    # transform's counters and events are taken back too (the untouched graph is compiled).
    attempt = contained(config.strict, "Inductor failed on the rewritten graph",
                        "Inductor failed on the rewritten graph")
    rewritten = gm
    if not env.disabled():
        rewritten = transform(gm, config)
    patches = inductor_options or None
    # (the chunk bodies' settings: kernels/ops/body_compiler.py)
    body_compiler.use_user_options(inductor_options)
    with backend_compiling():
        if rewritten is gm:
            return compile_fx(gm, example_inputs, config_patches=patches)
        # Never break a user's compile: if Inductor fails on the rewritten graph, compile
        # the untouched one (an error there is the user's, and propagates).
        with attempt:
            return compile_fx(rewritten, example_inputs, config_patches=_cacheable(patches))
        return compile_fx(gm, example_inputs, config_patches=patches)
