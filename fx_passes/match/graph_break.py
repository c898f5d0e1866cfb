"""Graph breaks between the upcast and the loss, and which compile to widen.

Dynamo gives each graph it compiles the reason it ended (``gm.compile_subgraph_reason``:
a break, with the user's frames, or the function's return).  A graph that ends at a break
and returns FP32 logits ``[.., V]`` made by an upcast in it has handed them to code the
pass cannot see (:func:`returned_at_break`: recorded in the session, said as a near
miss); a later graph of the same process that takes an FP32 tensor of that shape as an
input is the other half (:func:`taken_after_break`: a near miss naming both graphs, the
line of the break and what to change).  :func:`compiled_function` names the compile of a
graph, for the "loss outside the compiled function" hint.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.fx import Graph, Node

from ..fx.graph_ops import meta
from ..reporting.report import record_near_miss
from ..reporting.session import Handoff, session
from .region import where
from .upcast import upcast_ancestor, upcast_input

__all__ = ["returned_at_break", "taken_after_break", "compiled_function"]


def _reason(graph: Graph) -> Any:
    return getattr(graph.owning_module, "compile_subgraph_reason", None)


def _frame(f: Any) -> str:
    return f"{f.filename}:{f.lineno} ({f.name})"


def compiled_function(graph: Graph) -> Optional[str]:
    """``graph 0/1 of step (ends at train.py:40)``: the compile id, and the function and
    line where the graph ends (its return, or a break), when Dynamo said them."""
    gm, reason = graph.owning_module, _reason(graph)
    stack = list(getattr(reason, "user_stack", None) or [])
    if not stack:
        return None
    cid = (getattr(gm, "meta", None) or {}).get("dynamo_compile_id")
    first = stack[0]
    cid = cid if cid is not None else "?"
    return f"graph {cid} of {first.name} (ends at {first.filename}:{first.lineno})"


def _shape(v: torch.Tensor) -> tuple:
    return tuple(str(s) for s in v.shape)


def _fix(why: str) -> str:
    if why.lower().startswith("import"):
        return ("move the import out of the compiled code (to module level, or done once before "
                "torch.compile), so that Dynamo traces the upcast and the loss as one graph")
    return ("remove the break (TORCH_LOGS=graph_breaks prints it; torch._dynamo.config has switches for "
            "some, e.g. capture_scalar_outputs=True for .item()), or compute the loss before it, so that "
            "the upcast and the loss are in one graph")


def _outputs(graph: Graph) -> list[Node]:
    out = next(iter(graph.find_nodes(op="output")), None)
    found: list[Node] = []
    if out is not None:
        torch.fx.node.map_arg(out.args, found.append)
    return list(dict.fromkeys(found))


def _wide_fp32(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.dim() >= 2


def returned_at_break(graph: Graph) -> None:
    """Record (and hint at) the FP32 logits this graph returns at a graph break."""
    reason = _reason(graph)
    if reason is None or not getattr(reason, "graph_break", False):
        return
    for x in _outputs(graph):
        up = x if upcast_input(x) is not None else upcast_ancestor(x) if _wide_fp32(meta(x)) else None
        v = meta(x)
        if up is None or not _wide_fp32(v) or v.shape[-1] != meta(up).shape[-1]:
            continue
        why = str(reason.reason).strip().splitlines()[0]
        stack = list(reason.user_stack or [])
        broke_at = " -> ".join(_frame(f) for f in stack) or "?"
        h = Handoff(compiled_function(graph) or "a graph", _shape(v), where(up), broke_at, why)
        if h not in session.handoffs:
            session.handoffs.append(h)
        record_near_miss(where(x), (
            f"{h.graph} returns the FP32 logits {x.name} [{', '.join(h.shape)}] (upcast at {h.made}) because "
            f"Dynamo breaks the graph at {broke_at} ({why}): the loss that reads them is not in this "
            f"graph, so "
            f"the pass cannot remove the FP32 copy: {_fix(why)}"))


def taken_after_break(graph: Graph) -> None:
    """A placeholder of this graph that is the FP32 logits an earlier graph returned at a
    break: name both graphs and the break."""
    for p in graph.find_nodes(op="placeholder"):
        v = meta(p)
        if not _wide_fp32(v) or not p.users:
            continue
        for h in reversed(session.handoffs):
            if h.shape != _shape(v):
                continue
            here = compiled_function(graph) or "this graph"
            record_near_miss(where(p), (
                f"{here} takes the FP32 logits {p.name} [{', '.join(h.shape)}] that {h.graph} made "
                f"(upcast at "
                f"{h.made}) and returned at the graph break at {h.broke_at} ({h.why}): the upcast and "
                f"the loss are "
                f"in two graphs, so this one sees FP32 logits already and the other returns them whole: "
                f"{_fix(h.why)}"))
            break
