"""Adding nodes to a graph with their example values (what a later match reads)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.fx import Graph, Node

from .graph_ops import meta

__all__ = ["Emitter"]


class Emitter:
    """Adds nodes before ``anchor`` and fills in their example values."""

    def __init__(self, graph: Graph, anchor: Node) -> None:
        self.graph, self.anchor = graph, anchor
        self.added: list[Node] = []

    def _example(self, fn: Callable, args: tuple, kwargs: dict, mode: Any = None) -> Any:
        def val(a):
            return meta(a) if isinstance(a, Node) else a
        args = torch.fx.node.map_aggregate(args, val)
        kwargs = torch.fx.node.map_aggregate(kwargs, val)
        modes = {a.fake_mode for a in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(a, torch._subclasses.FakeTensor)} or ({mode} if mode is not None else set())
        if len(modes) != 1:
            raise RuntimeError(f"chunked_logits: expected one fake mode in example values, got {len(modes)}")
        with modes.pop():
            return fn(*args, **kwargs)

    def fill(self, nodes: list[Node]) -> None:
        """Give each of ``nodes`` (added without one, in graph order) its example value
        where it can be computed (what a later match reads), best effort."""
        fakes = [v for p in self.graph.find_nodes(op="placeholder")
                 if isinstance(v := meta(p), torch._subclasses.FakeTensor)]
        mode = fakes[0].fake_mode if fakes else None  # (for a node of numbers: a temperature's 0-d tensor)
        for n in nodes:
            if n.op not in ("call_function", "call_method") or meta(n) is not None:
                continue
            try:
                if n.op == "call_function":
                    n.meta["example_value"] = self._example(n.target, n.args, n.kwargs, mode)
                else:
                    n.meta["example_value"] = self._example(
                        lambda self_, *a, **k: getattr(self_, n.target)(*a, **k), n.args, n.kwargs, mode)
            except Exception:  # noqa: BLE001 - a node without one is one a match declines
                continue

    def function(self, fn: Callable, *args: Any, **kwargs: Any) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(fn, args, kwargs)
        node.meta["example_value"] = self._example(fn, args, kwargs)
        self.added.append(node)
        return node

    def method(self, name: str, *args: Any, **kwargs: Any) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_method(name, args, kwargs)
        node.meta["example_value"] = self._example(
            lambda self_, *a, **k: getattr(self_, name)(*a, **k), args, kwargs)
        self.added.append(node)
        return node
