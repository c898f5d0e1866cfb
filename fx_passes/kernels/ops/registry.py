"""The run-time registries: what a rewrite registers while it compiles a graph and a
custom op reads while the compiled graph runs, by a string key that the rewritten graph
carries as a constant argument (a custom op takes tensors, numbers and strings, not
Python objects).  Every such table of the package is here (compiled chunk bodies are
cached by :mod:`fx_passes.kernels.ops.body_compiler`).  Entries live as long as the process; keys
are content hashes, the same in every process.  See NOTE [registries].
"""

# NOTE [registries]
# ========================  ====================================  ===================================
# registry                  registered by (compile time)          read by (run time)
# ========================  ====================================  ===================================
# ``GRAPH_BODIES``          ``user_bodies.register``: a          ``user_bodies.body`` /
#                           vocab-parallel stage's reductions,    ``backward_body`` (compile them),
#                           or a row-local region, as an FX graph ``user_bodies.function``
# ``GATHER_INDEXES``        ``shard_lm_head.gather_index_         the lm_head stage loop (which
#                           positions``                           operands are gather indexes)
# ``ONE_PASS_PLANS``        ``distributed.one_pass.register``     ``shard_lm_head_stages``
# ``REPLAYING_BODIES``      ``rewrite.row_local``: a region       ``row_local`` (its backward runs
#                           body that saves state -> (the key of  the replaying body on the
#                           the body replaying it, how many)      saved state)
# ``EMITTED``               ``@emitted`` (import time): each      ``pipeline.with_cacheable_marks``,
#                           function a rewritten graph calls      the tests (NOTE [emitted functions])
# ========================  ====================================  ===================================
#
# Lifetime: the whole process; nothing is removed (an entry is small: a graph module, a
# tuple, or a compiled function).  Keys are content hashes of what they name (a stage's
# code, a plan's steps), so the same stage in two graphs, or in two compiles of one graph,
# shares one entry, and a key means the same thing in every process.  A warm start (a new
# process whose compiled graphs come from AOTAutograd's cache) is served because Dynamo
# traces again and the pass runs again before the cache lookup: it registers the same keys
# before any op reads them.  A key read before it was registered is a bug of the pass, and
# the error says so.

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Generic, Iterator, Optional, TypeVar

import torch

__all__ = ["Registry", "GRAPH_BODIES", "GATHER_INDEXES", "ONE_PASS_PLANS", "REPLAYING_BODIES", "EMITTED",
           "Emitted", "emitted", "target_name", "cacheable_names", "CAPTURE_SAFE", "CUDAGRAPH_UNSAFE",
           "UNSAFE"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable)


class Registry(Generic[T]):
    """A process-global table from key to value; first registration wins."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._items: dict[Any, T] = {}

    def add(self, key: Any, value: T) -> Any:
        self._items.setdefault(key, value)
        return key

    def __getitem__(self, key: Any) -> T:
        try:
            return self._items[key]
        except KeyError:
            raise KeyError(f"chunked_logits: no {self.what} registered under {key!r} (the pass registers "
                           "it while it rewrites the graph that uses it)") from None

    def get(self, key: Any, default: Any = None) -> Any:
        return self._items.get(key, default)

    def __contains__(self, key: Any) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


GRAPH_BODIES: Registry = Registry("region body (an FX graph)")
GATHER_INDEXES: Registry = Registry("gather index positions")
ONE_PASS_PLANS: Registry = Registry("one-pass plan")
REPLAYING_BODIES: Registry = Registry("replaying body of a region that saves state for its backward")


# ---- the functions a rewritten graph calls ----------------------------------------------------
# NOTE [emitted functions]: each function a rewrite puts into a graph as a ``call_function``
# target carries ``@emitted(...)`` where it is defined.  The registry feeds Inductor's
# ``unsafe_marked_cacheable_functions`` (``pipeline.with_cacheable_marks``: AOTAutograd's
# cache stores a graph only when it can vouch for every call in it) and records the CUDA
# graph decision of each custom op the function runs: ``CAPTURE_SAFE`` (no host read, no
# host tensor, the same allocations every replay) or ``CUDAGRAPH_UNSAFE`` (the op carries
# ``torch.Tag.cudagraph_unsafe``, so Inductor's ``mode="reduce-overhead"`` partitions the
# graph around it and runs it outside the captured parts).  A function without ops is
# traced through by AOTAutograd (its torch ops are Inductor's to capture).
# tests/test_gpu_registry.py fails when a rewrite emits a target that is not registered, or
# an op's tag disagrees with its entry.

CAPTURE_SAFE, CUDAGRAPH_UNSAFE = "capture-safe", "cudagraph_unsafe"
UNSAFE = (torch.Tag.cudagraph_unsafe,)  # the tags= of a custom op that is CUDAGRAPH_UNSAFE


@dataclasses.dataclass(frozen=True)
class Emitted:
    """A function a rewritten graph calls: its name as Inductor's cacheable marks spell it
    (``module.__name__``), the custom ops it runs (``chunked_logits::name``, forward and
    backward) and their CUDA graph decision (None: no op, traced through)."""

    name: str
    ops: tuple[str, ...]
    capture: Optional[str]


EMITTED: Registry = Registry("function a rewritten graph calls")


def target_name(fn: Callable) -> str:
    """``fn``'s name in Inductor's ``unsafe_marked_cacheable_functions``."""
    return f"{fn.__module__}.{fn.__name__}"


def emitted(ops: tuple[str, ...] = (), capture: Optional[str] = None) -> Callable[[F], F]:
    """Register the decorated function as one a rewritten graph calls (NOTE [emitted functions])."""
    if bool(ops) != (capture is not None) or capture not in (None, CAPTURE_SAFE, CUDAGRAPH_UNSAFE):
        raise ValueError(f"emitted(ops={ops!r}, capture={capture!r}): a function that runs custom ops "
                         f"says {CAPTURE_SAFE!r} or {CUDAGRAPH_UNSAFE!r}; one without ops says neither")

    def mark(fn: F) -> F:
        EMITTED.add(target_name(fn), Emitted(target_name(fn), tuple(ops), capture))
        return fn
    return mark


def cacheable_names() -> tuple[str, ...]:
    """Every registered function's name (what ``pipeline.with_cacheable_marks`` marks)."""
    return tuple(EMITTED)
