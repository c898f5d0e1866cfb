"""Gradients in the forward: a fused lm_head region and its loss tail become one call.

Before (after the region's rewrite, :mod:`fx_passes.rewrite.logits`)::

    stats   = lm_head_row_stats(hidden, weight, None, tokens, None, True, False, ...)
    getitem = stats[1]
    mul     = getitem * advantages
    mean    = mul.mean()
    neg     = -mean

After::

    neg = lm_head_loss(hidden, weight, None, tokens, None, True, False, ..., 'two_sweeps',
                       '<tail key>', '<final key>', 'mean:float32', True, True, 1, advantages)

The tail (:mod:`fx_passes.match.loss_tail`) becomes two FX graphs registered in
``GRAPH_BODIES``: the row part ``tail(lse, logprob, entropy, *rows, *whole)`` returning
the tensors the loss sums (views are identities there: every tensor is the flat rows of
a chunk), and the scalar part ``final(*reductions, *whole)`` giving the loss.  The call
runs where the loss was (``fx/placement.check_placement``: no in-place change between the
region's call and the loss, the same autocast blocks, one grad mode).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._dynamo.utils import counters
from torch.fx import Graph, GraphModule, Node

from ..config import Config
from ..fx.graph_ops import meta, requires_grad
from ..fx.placement import check_placement
from ..kernels import graph_bodies
from ..kernels.lm_head import lm_head_row_stats
from ..kernels.lm_head_loss import PLANS, lm_head_loss, trace_tail
from ..kernels.tiling import backward_plan
from ..match.loss_tail import VIEWS, LossTail, NoTail, match_loss_tail
from ..match.row_local import op_name
from ..reporting.report import COUNTER, Decline, log
from .logits import Emitter

__all__ = ["rewrite_loss_tail", "fused_calls", "GEMMS"]

# model-precision-input GEMMs of one step, in units of [T, H] x [H, V], per plan (unit incoming gradient)
GEMMS = {"gpu": 3, "two_sweeps": 4}


def fused_calls(graph: Graph) -> set[Node]:
    """The fused lm_head calls of ``graph`` (each may have a loss tail)."""
    return {n for n in graph.nodes if n.op == "call_function" and n.target is lm_head_row_stats}


def _plan(tail: LossTail) -> str:
    """The plan the op runs (``tiling.backward_plan`` of the region's device and dtype)."""
    hidden = meta(tail.stats.args[0])
    plan = backward_plan(hidden.device, hidden.dtype, tail.stats.args[9])
    if plan not in PLANS:
        raise NoTail(f"the {plan!r} plan computes no gradient in the forward")
    return plan


def _check(graph: Graph, tail: LossTail) -> None:
    hidden, weight, bias = tail.stats.args[:3]
    operands = [o for o in (hidden, weight, bias) if isinstance(o, Node)]
    detach = check_placement(graph, tail.nodes, tail.loss, [tail.loss],
                             [*operands, *tail.row_operands, *tail.whole], tail.loss, operands)
    if detach:
        raise NoTail("its nodes run under different grad modes")


def _bodies(tail: LossTail) -> tuple[str, str]:
    """(tail key, final key): the row part and the scalar part as registered FX graphs."""
    rows, env = Graph(), {}
    items = [rows.placeholder(name) for name in ("lse", "logprob", "entropy")]
    for node, i in tail.items.items():
        env[node] = items[i]
    for o in [*tail.row_operands, *tail.whole]:
        env[o] = rows.placeholder(o.name)
    for n in tail.rows:
        env[n] = env[n.args[0]] if op_name(n) in VIEWS else rows.node_copy(n, env.__getitem__)
    rows.output(tuple(env[r.all_input_nodes[0]] for r in tail.reductions))
    final, env2 = Graph(), {}
    for r in tail.reductions:
        env2[r] = final.placeholder(r.name)
    for o in tail.whole:
        env2[o] = final.placeholder(o.name)
    for n in tail.scalars:
        env2[n] = final.node_copy(n, env2.__getitem__)
    final.output(env2[tail.loss])
    rows_key = graph_bodies.register(GraphModule(torch.nn.Module(), rows))
    device = meta(tail.stats.args[0]).device
    examples = [torch.zeros(3, device=device) for _ in range(3)]
    examples += [torch.zeros(3, dtype=meta(o).dtype, device=device) for o in tail.row_operands]
    examples += [_whole_example(o, device) for o in tail.whole]
    examples += [torch.zeros((), device=device) for _ in tail.reductions]
    tail_key = trace_tail(rows_key, len(tail.row_operands) + len(tail.whole), examples)
    return tail_key, graph_bodies.register(GraphModule(torch.nn.Module(), final))


def _whole_example(node: Node, device: torch.device) -> torch.Tensor:
    """A 0-d tensor like the one ``lm_head_loss`` makes of ``node`` at run time."""
    v = meta(node)
    if isinstance(v, torch.Tensor):
        return torch.zeros((), dtype=v.dtype, device=device)
    return torch.zeros((), dtype=torch.float32 if isinstance(v, (float, torch.SymFloat)) else torch.int64,
                       device=device)


def rewrite_loss_tail(graph: Graph, stats: Node, config: Config) -> Optional[str]:
    """Replace the fused call ``stats`` and its loss tail by one :func:`lm_head_loss` call;
    what to add to the rewrite's log line, or None where the region keeps the recompute
    path (the reason logged at debug level)."""
    if not config.gradients_in_forward:
        return None
    try:
        tail = match_loss_tail(graph, stats)
        plan = _plan(tail)
        _check(graph, tail)
    except (NoTail, Decline) as why:
        log.debug("chunked_logits: %s: no gradients in the forward: %s", stats.name, why)
        return None
    tail_key, final_key = _bodies(tail)
    kinds = ",".join(f"{op_name(r)}:{str(meta(r).dtype).removeprefix('torch.')}" for r in tail.reductions)
    hidden, weight, bias, tokens, scale, scale_is_div, want_entropy, budget, transforms = stats.args[:9]
    e = Emitter(graph, tail.loss)
    call = e.function(lm_head_loss, hidden, weight, bias, tokens, scale, scale_is_div, want_entropy, budget,
                      transforms, plan, tail_key, final_key, kinds, requires_grad(hidden),
                      requires_grad(weight) or requires_grad(bias), len(tail.row_operands),
                      *tail.row_operands, *tail.whole)
    tail.loss.replace_all_uses_with(call)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(tail.nodes, key=order.__getitem__, reverse=True):
        graph.erase_node(n)
    counters[COUNTER]["gradients_in_forward"] += 1
    return (f", gradients in the forward through its {tail.describe()} ({plan}: "
            f"{GEMMS[plan]} GEMMs a step with a unit incoming gradient)")
