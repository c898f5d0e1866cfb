"""fx/graph_ops.py's one naming scheme: ``op_name`` (ATen's name of any call) and ``canon``
(that name for the matcher's known spellings, one op's spellings merged)."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.fx import Graph

from fx_passes.fx.graph_ops import _SPELLINGS, canon, op_name
from fx_passes.fx.placement import movable_before

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


# fx/placement.movable_before: what may move before a node, exactly

def _late(*between):
    """``anchor = x.sum()``, then the ops ``between(g, m)`` make, then ``m.float()[:, None]``."""
    g = Graph()
    x, m = g.placeholder("x"), g.placeholder("m")
    anchor = g.call_function(torch.sum, (x,))
    for make in between:
        make(g, m, anchor)
    f = g.call_method("float", (m,))
    col = g.call_function(operator.getitem, (f, (slice(None), None)))
    g.output((anchor, col))
    return g, anchor, [f, col]


def test_a_conversion_and_a_view_move_in_order():
    g, anchor, late = _late()
    assert movable_before(g, anchor, late[-1:]) == late


@pytest.mark.parametrize("between,said", [
    (lambda g, m, a: g.call_method("mul_", (m, 2)), "changes in place"),
    (lambda g, m, a: g.call_method("mul_", (g.call_method("view", (m, -1)), 2)), "changes in place"),
])
def test_an_in_place_change_in_between_keeps_it(between, said):
    g, anchor, late = _late(between)
    assert said in movable_before(g, anchor, late[-1:])


def test_a_random_draw_a_region_node_or_the_anchor_itself_does_not_move():
    g = Graph()
    x, m = g.placeholder("x"), g.placeholder("m")
    anchor = g.call_function(torch.sum, (x,))
    drawn = g.call_function(torch.rand_like, (m,))
    after = g.call_function(torch.mul, (anchor, m))
    g.output((drawn, after))
    assert "cannot move" in movable_before(g, anchor, [drawn])
    assert "reads" in movable_before(g, anchor, [after])  # (it reads the anchor)
    assert "reads" in movable_before(g, drawn, [after], avoid=frozenset([anchor]))
