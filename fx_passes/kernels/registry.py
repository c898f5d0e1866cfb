"""The run-time registries: what a rewrite registers while it compiles a graph and a
custom op reads while the compiled graph runs, by a string key that the rewritten graph
carries as a constant argument (a custom op takes tensors, numbers and strings, not
Python objects).  Every such table of the package is here (compiled chunk bodies are cached by
:mod:`fx_passes.kernels.compiler`, keyed by what they compile):

========================  ====================================  ===================================
registry                  registered by (compile time)          read by (run time)
========================  ====================================  ===================================
``GRAPH_BODIES``          ``graph_bodies.register``: a          ``graph_bodies.body`` /
                          vocab-parallel stage's reductions,    ``backward_body`` (compile them),
                          or a row-local region, as an FX graph ``graph_bodies.function``
``GATHER_INDEXES``        ``shard_lm_head.gather_index_         the lm_head stage loop (which
                          positions``                           operands are gather indexes)
``ONE_PASS_PLANS``        ``distributed.one_pass.register``     ``shard_lm_head_stages``
``REPLAYING_BODIES``      ``rewrite.row_local``: a region       ``row_local`` (its backward runs
                          body that saves state -> (the key of  the replaying body on the
                          the body replaying it, how many)      saved state)
========================  ====================================  ===================================

Lifetime: the whole process; nothing is removed (an entry is small: a graph module, a
tuple, or a compiled function).  Keys are content hashes of what they name (a stage's
code, a plan's steps), so the same stage in two graphs, or in two compiles of one graph,
shares one entry, and a key means the same thing in every process.  A warm start (a new
process whose compiled graphs come from AOTAutograd's cache) is served because Dynamo
traces again and the pass runs again before the cache lookup: it registers the same keys
before any op reads them.  A key read before it was registered is a bug of the pass, and
the error says so.
"""

from __future__ import annotations

from typing import Any, Generic, Iterator, TypeVar

__all__ = ["Registry", "GRAPH_BODIES", "GATHER_INDEXES", "ONE_PASS_PLANS", "REPLAYING_BODIES"]

T = TypeVar("T")


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
