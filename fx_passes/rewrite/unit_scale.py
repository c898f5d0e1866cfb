"""Drop ``x / 1`` and ``x * 1``: no-ops that still allocate a full copy of ``x``.

Inductor keeps them today (its no-op rule skips scalar operands), and a trainer's
``logits / temperature`` with temperature 1.0 is exactly that: a full-size copy of
the logits for nothing.  Only a Python constant 1 counts; a temperature that is a
graph input (a 0-d tensor, or a float that ``dynamic=True`` made an input) is a
runtime value and stays.
"""

from __future__ import annotations

from torch.fx import Graph, Node

from ..fx.graph_ops import is_pure, meta, scaled_by_number
from ..fx.placement import mutates, view_family

__all__ = ["remove_div_by_one"]


def _unit_operand_input(node: Node):
    """The tensor operand of ``t / 1``, ``t * 1`` or ``1 * t``; else None."""
    scaled = scaled_by_number(node)
    return scaled[0] if scaled is not None and scaled[1] == 1 else None


def _aliases_output(graph: Graph, node: Node, src: Node) -> bool:
    """Would replacing ``node`` by ``src`` make an output alias an input or another output?"""
    outputs = [n for n in graph.nodes if n.op == "output"]
    if not outputs or node not in outputs[0].all_input_nodes:
        return False
    flat = list(outputs[0].all_input_nodes)
    return src.op == "placeholder" or src in flat


def remove_div_by_one(graph: Graph) -> int:
    """Remove unit scalings whose result has the input's dtype and shape; returns the count."""
    removed = 0
    for node in list(graph.nodes):
        src = _unit_operand_input(node)
        if src is None:
            continue
        vin, vout = meta(src), meta(node)
        if (getattr(vin, "dtype", None) is None or vin.dtype != vout.dtype
                or vin.shape != vout.shape or vin.device != vout.device
                or getattr(vin, "requires_grad", False) != getattr(vout, "requires_grad", False)):
            continue
        if _aliases_output(graph, node, src):
            continue
        if not all(is_pure(u) or u.op == "output" for u in (*node.users, *src.users)):
            continue  # an in-place op would see (or cause) the aliasing
        family = view_family(node) | view_family(src)
        if any(mutates(u) for f in family for u in f.users):
            continue  # ``y = x * 1; y[:2].zero_()`` must not change x
        node.replace_all_uses_with(src)
        graph.erase_node(node)
        removed += 1
    return removed
