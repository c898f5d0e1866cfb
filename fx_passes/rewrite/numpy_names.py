"""NumPy's argument names on torch's own ops, spelled with torch's names.

``(loss * mask).sum(axis=-1) / mask.sum(axis=-1)`` (OpenRLHF's and verl's ``masked_mean``)
is ``sum(dim=-1)``: torch's argument parser takes ``axis`` for ``dim`` and ``keepdims``
for ``keepdim`` on every op it parses, and Dynamo's graph keeps the names the user
wrote, which the matchers (the loss tail, the per-sequence sums) do not read.
NOTE [numpy names].
"""

# NOTE [numpy names]
# A call is renamed only where torch's C++ argument parser reads its arguments: a
# ``Tensor`` method or a ``torch.*`` function that is a builtin (not ``F.*`` and other
# Python functions, which take no such aliases: there ``axis=`` was the user's own
# argument, or an error).  Renamed: ``axis`` -> ``dim``, ``keepdims`` -> ``keepdim``
# (never where both spellings are given: the parser would refuse the call), and a
# ``dim=None`` of ``sum`` / ``mean`` dropped (both then reduce every dim, as without
# it).  The call is the one the parser makes of the user's: the program is unchanged.

from __future__ import annotations

import types

import torch
from torch.fx import Graph, Node

from ..fx.graph_ops import meta

__all__ = ["torch_names"]

_ALIASES = {"axis": "dim", "keepdims": "keepdim"}
_ALL_DIMS_BY_NONE = {"sum", "mean"}


def _parsed_by_torch(node: Node) -> bool:
    """Does torch's C++ argument parser read ``node``'s arguments?"""
    if node.op == "call_method":
        method = getattr(torch.Tensor, str(node.target), None)
        return isinstance(method, (types.MethodDescriptorType, types.BuiltinFunctionType)) \
            and bool(node.args) and isinstance(meta(node.args[0]), torch.Tensor)
    return (node.op == "call_function" and isinstance(node.target, types.BuiltinFunctionType)
            and getattr(torch, getattr(node.target, "__name__", ""), None) is node.target)


def _name(node: Node) -> str:
    return str(node.target) if node.op == "call_method" else node.target.__name__


def torch_names(graph: Graph) -> int:
    """Rename NumPy's argument names on the calls torch parses (NOTE [numpy names]);
    returns how many calls changed."""
    changed = 0
    for node in graph.nodes:
        kwargs = dict(node.kwargs)
        if not any(k in kwargs for k in _ALIASES) or not _parsed_by_torch(node):
            continue
        if any(k in kwargs and v in kwargs for k, v in _ALIASES.items()):
            continue
        kwargs = {_ALIASES.get(k, k): v for k, v in kwargs.items()}
        if _name(node) in _ALL_DIMS_BY_NONE and "dim" in kwargs and kwargs["dim"] is None \
                and not kwargs.get("keepdim", False):
            kwargs.pop("dim")
            kwargs.pop("keepdim", None)
        node.kwargs = kwargs
        changed += 1
    return changed
