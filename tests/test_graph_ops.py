"""fx/graph_ops.py's one naming scheme: ``op_name`` (ATen's name of any call) and ``canon``
(that name for the matcher's known spellings, one op's spellings merged)."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.fx import Graph

from fx_passes.fx.graph_ops import _SPELLINGS, canon, op_name

SPELLINGS = [(name, "call_function", fn) for name, (fns, _) in _SPELLINGS.items() for fn in fns] + \
    [(name, "call_method", m) for name, (_, methods) in _SPELLINGS.items() for m in methods]


def _node(kind: str, target):
    g = Graph()
    x = g.placeholder("x")
    return g.call_function(target, (x,)) if kind == "call_function" else g.call_method(target, (x,))


@pytest.mark.parametrize("name,kind,target", SPELLINGS, ids=[f"{n}-{getattr(t, '__name__', t)}"
                                                             for n, _, t in SPELLINGS])
def test_every_spelling_has_its_canonical_name(name, kind, target):
    assert canon(_node(kind, target)) == name


@pytest.mark.parametrize("kind,target,aten,canonical", [
    ("call_function", torch.sigmoid, "sigmoid", None),
    ("call_function", operator.and_, "bitwise_and", None),
    ("call_method", "__rmul__", "mul", "mul"),  # (a known spelling: ``2 * x``)
    ("call_method", "masked_fill", "masked_fill", None),
])
def test_any_call_has_its_aten_name(kind, target, aten, canonical):
    node = _node(kind, target)
    assert op_name(node) == aten
    assert canon(node) == canonical
