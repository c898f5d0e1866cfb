"""Put the passes into the stock ``inductor`` backend: ``install`` / ``uninstall``.

    import fx_passes
    fx_passes.install()                      # every later torch.compile(...) in the process
    fx_passes.install(report_only=True)      # options are Config fields
    fx_passes.uninstall()

    with fx_passes.install(temperature_after_upcast=False):
        ...                                  # installed inside the block only

The pass goes into ``pre_grad_custom_pass`` in front of a user's own pass (kept; put back
by ``uninstall``); installing twice replaces the options.  See NOTE [install].
"""

# NOTE [install]
# The pass goes into ``torch._inductor.config.pre_grad_custom_pass`` in front of any
# pass already there (a user's own pass is kept, never dropped, and is put back as it
# was by ``uninstall``).  Installing twice replaces the options, it never adds a
# second copy; a graph that the ``chunked_logits`` backend already rewrote is not
# rewritten again.  ``CHUNKED_LOGITS_DISABLE=1`` turns the installed pass off at
# compile time, like the backend.
#
# While installed, Inductor's ``pre_grad_pass_timing`` is ``"early"`` (when it was
# ``"default"``; torch before 2.12 has no such setting and always runs them early):
# pre-grad passes then run before the compile-cache lookup, so the cache key is the
# rewritten graph and every compile reports what it rewrote, even when the compiled
# code comes from the cache.  What each torch version lacks: :mod:`fx_passes.compat`.
#
# This module imports no more of torch than Inductor's config, so that the
# environment switch costs nothing until something is compiled.

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import threading
from typing import Any, Iterator, Optional

import torch
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph

from .. import compat, env
from ..config import Config
from ..reporting.report import note_graph
from ..reporting.session import session

__all__ = ["install", "uninstall", "installed_config", "Installation", "InstalledPass",
           "install_from_env", "backend_compiling"]

log = logging.getLogger("fx_passes")
_lock = threading.RLock()
# Set by the chunked_logits backend while it compiles a graph it already transformed.
_backend_active: contextvars.ContextVar[bool] = contextvars.ContextVar("chunked_logits_backend",
                                                                      default=False)


@contextlib.contextmanager
def backend_compiling() -> Iterator[None]:
    """Around the backend's call to Inductor: the installed pass leaves that graph alone."""
    token = _backend_active.set(True)
    try:
        yield
    finally:
        _backend_active.reset(token)


class InstalledPass(CustomGraphPass):
    """The passes as they sit in ``pre_grad_custom_pass`` after :func:`install`."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._impl = None

    def __call__(self, graph: Graph) -> None:
        if env.disabled() or _backend_active.get():
            return
        if self._impl is None:
            from ..pipeline import ChunkedLogitsPass

            self._impl = ChunkedLogitsPass(self.config)
        note_graph()
        self._impl(graph)  # its fall-back keeps the graph's own placeholders (fx.graph_ops.restore_graph)

    def uuid(self) -> str:
        from ..pipeline import source_hash

        state = "off" if env.disabled() else "on"
        return f"chunked_logits-installed-{source_hash()[:16]}-{self.config.key()}-{state}"

    def __repr__(self) -> str:
        return f"fx_passes.InstalledPass({self.config})"


@dataclasses.dataclass
class _State:
    current: Optional[InstalledPass] = None
    container: str = "none"  # what pre_grad_custom_pass was when we first chained: none|single|list|tuple
    timing_changed: bool = False


_state = _State()


def _ours(p: Any) -> bool:
    return isinstance(p, InstalledPass)


def _present() -> Optional[InstalledPass]:
    for p in compat.custom_graph_passes(inductor_config.pre_grad_custom_pass):
        if _ours(p):
            return p
    return None


def _dropped() -> bool:
    """Was the installed pass replaced (``pre_grad_custom_pass`` assigned over it)?"""
    return _state.current is not None and _present() is None


def installed_config() -> Optional[Config]:
    """The Config of the installed pass, or None when it is not installed."""
    with _lock:
        p = _present()
        return p.config if p is not None else None


def _put(new: InstalledPass) -> bool:
    """Put ``new`` in front of the other pre-grad passes; False where this torch takes one."""
    value = inductor_config.pre_grad_custom_pass
    others = [p for p in compat.custom_graph_passes(value) if not _ours(p)]
    if others and not compat.PASS_LISTS:
        log.warning("chunked_logits: not installed: torch %s takes one pre_grad_custom_pass and "
                    "yours is set (%r); use torch.compile(..., backend='chunked_logits')",
                    torch.__version__, others[0])
        return False
    if _present() is None:
        _state.container = ("none" if value is None else "list" if isinstance(value, list)
                            else "tuple" if isinstance(value, tuple) else "single")
    if not others and not isinstance(value, (list, tuple)):
        inductor_config.pre_grad_custom_pass = new
    else:
        kind = list if isinstance(value, list) else tuple
        inductor_config.pre_grad_custom_pass = kind([new, *others])
    if compat.PRE_GRAD_PASS_TIMING and inductor_config.pre_grad_pass_timing == "default":
        inductor_config.pre_grad_pass_timing = "early"
        _state.timing_changed = True
    if compat.CACHEABLE_MARKS:  # AOTAutograd's cache may store rewritten graphs
        from ..pipeline import with_cacheable_marks
        inductor_config.unsafe_marked_cacheable_functions = with_cacheable_marks(
            inductor_config.unsafe_marked_cacheable_functions)
    _state.current = new
    return True


def _remove() -> bool:
    value = inductor_config.pre_grad_custom_pass
    passes = compat.custom_graph_passes(value)
    rest = [p for p in passes if not _ours(p)]
    removed = len(rest) != len(passes)
    if removed:
        if not rest and _state.container in ("none", "single"):
            inductor_config.pre_grad_custom_pass = None
        elif len(rest) == 1 and _state.container in ("none", "single"):
            inductor_config.pre_grad_custom_pass = rest[0]
        else:
            inductor_config.pre_grad_custom_pass = (list if isinstance(value, list) else tuple)(rest)
    if _state.timing_changed and inductor_config.pre_grad_pass_timing == "early":  # set: it exists
        inductor_config.pre_grad_pass_timing = "default"
    if removed and compat.CACHEABLE_MARKS:
        from ..pipeline import cacheable
        inductor_config.unsafe_marked_cacheable_functions = {
            k: v for k, v in inductor_config.unsafe_marked_cacheable_functions.items()
            if k not in cacheable()}
    _state.timing_changed = False
    _state.current = None
    _state.container = "none"
    return removed


class Installation:
    """What :func:`install` returns; also a context manager that undoes the install."""

    def __init__(self, config: Config, previous: Optional[Config]) -> None:
        self.config = config
        self.previous = previous

    def __enter__(self) -> "Installation":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            install(self.previous)
        else:
            uninstall()

    def __repr__(self) -> str:
        return f"fx_passes.Installation({self.config})"


def install(config: Optional[Config] = None, /, **options: Any) -> Installation:
    """Put the passes into the stock ``inductor`` backend for every later compile.

    ``options`` are :class:`~fx_passes.config.Config` fields (unknown ones are a
    ValueError); or pass a Config.  Installing again replaces the options.  Use the
    result as a context manager to undo the install at the end of a block.
    """
    if config is None:
        config = Config.from_options(options)
    elif options:
        config = Config.from_options(dataclasses.asdict(config), **options)
    with _lock:
        previous = installed_config()
        placed = _put(InstalledPass(config))
    if placed:
        session.note_installed(config, dropped=_dropped)
    return Installation(config, previous)


def uninstall() -> bool:
    """Take the passes out of Inductor again; a user's own passes stay.  True if removed."""
    with _lock:
        return _remove()


# --- the environment switch -------------------------------------------------------

def install_from_env() -> Optional[Installation]:
    """What ``CHUNKED_LOGITS=1`` does once Inductor's config is imported."""
    if env.disabled():
        return None
    config = Config.from_options(env.options())
    result = install(config)
    from ..reporting import summary

    summary.arm_from_env()
    return result
