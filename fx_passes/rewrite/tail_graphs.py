"""A loss tail as FX graphs: the row part and the scalar part that ``lm_head_loss`` and
``row_local_loss`` run (NOTE [loss tail graphs]).

``_bodies``: the row part over the fused call's per-row results and the scalar part, both
registered; ``_joined``: a row-local region's body followed by its tail's row part;
``_final`` / ``_factors``: the scalar part and, in FP64, the loss's derivative by each
reduction (the part is affine in them).  :mod:`fx_passes.rewrite.loss_tail` calls them.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, GraphModule, Node

from ..fx.graph_ops import meta, op_name
from ..fx.op_rules import Kind, tail_rule
from ..kernels.log_softmax.loss_parts import trace_tail
from ..kernels.ops import user_bodies
from ..kernels.ops.args import head_of_node
from ..match.loss_tail import VIEWS, LossTail, NoTail

# NOTE [loss tail graphs]
# The tail (:mod:`fx_passes.match.loss_tail`) becomes two FX graphs registered in
# ``GRAPH_BODIES``: the row part ``tail(lse, logprob, entropy, *rows, *whole)`` returning
# the tensors the loss sums (views are identities there: every tensor is the flat rows of
# a chunk), and the scalar part ``final(*reductions, *whole)`` giving the loss.  The call
# runs where the loss was (``fx/placement.check_placement``: no in-place change between the
# region's call and the loss, the same autocast blocks, one grad mode).


def _bodies(tail: LossTail) -> tuple[str, str]:
    """(tail key, final key): the row part and the scalar part as registered FX graphs."""
    rows, env = Graph(), {}
    items = [rows.placeholder(name) for name in ("lse", "logprob", "entropy")]
    for node, i in tail.items.items():
        env[node] = items[i]
    for o in [*tail.row_operands, *tail.whole]:
        env[o] = rows.placeholder(o.name)
    _copy_rows(rows, tail, env)
    rows_key = user_bodies.register(GraphModule(torch.nn.Module(), rows))
    device = meta(head_of_node(tail.stats).hidden).device
    examples = [torch.zeros(3, device=device) for _ in range(3)]
    examples += [torch.zeros(3, dtype=meta(o).dtype, device=device) for o in tail.row_operands]
    examples += [_whole_example(o, device) for o in tail.whole]
    examples += [torch.zeros((), device=device) for _ in tail.reductions]
    tail_key = trace_tail(rows_key, len(tail.row_operands) + len(tail.whole), examples)
    return tail_key, _final(tail)


def _copy_rows(g: Graph, tail: LossTail, env: dict) -> None:
    """The tail's row part into ``g`` (``env``: its inputs), returning what the loss
    sums: every tensor is a chunk's flat rows, so the views are identities."""
    for n in tail.rows:
        env[n] = env[n.args[0]] if op_name(n) in VIEWS else g.node_copy(n, env.__getitem__)
    g.output(tuple(env[r.all_input_nodes[0]] for r in tail.reductions))


def _final(tail: LossTail) -> str:
    """The key of the scalar part ``final(*reductions, *whole) -> (loss, *weights)``,
    ``weights[k] = d loss / d reductions[k]`` (:func:`_factors`)."""
    final, env = Graph(), {}
    for r in tail.reductions:
        env[r] = final.placeholder(r.name)
    for o in tail.whole:
        env[o] = final.placeholder(o.name)
    for n in tail.scalars:
        env[n] = final.node_copy(n, env.__getitem__)
    final.output((env[tail.loss], *_factors(final, tail, env)))
    return user_bodies.register(GraphModule(torch.nn.Module(), final))


def _factors(g: Graph, tail: LossTail, env: dict) -> list[Node]:
    """Nodes of ``g`` computing, in FP64, ``d loss / d reductions[k]`` from the values the
    scalar part reads whole (``env``: their placeholders).  The part is affine in the
    reductions (``match/loss_tail.py``), so each factor is the product of the factors met
    on the way to the loss: a constant term (``+ ref.mean()``, infinite or not) plays no
    part, as in autograd."""
    k = len(tail.reductions)
    whole = {o: g.call_method("double", (g.call_function(torch.as_tensor, (env[o],)),)) for o in tail.whole}

    def value(a):
        return whole[a] if isinstance(a, Node) else a

    def times(c, f, op=operator.mul):
        if c is None:
            return None
        return g.call_function(op, (c, f)) if isinstance(c, Node) or isinstance(f, Node) else op(c, f)

    def plus(c, d):
        return c if d is None else d if c is None else times(c, d, operator.add)
    coef: dict[Node, list] = {r: [1.0 if j == i else None for j in range(k)]
                              for i, r in enumerate(tail.reductions)}
    for n in tail.scalars:
        name, args = op_name(n), list(n.args)
        rule, why = tail_rule(n, name)  # (the matcher took it: fx/op_rules.py, the same table)
        if rule is None:
            raise NoTail(f"{n.name}: {why}")
        if str(n.target).startswith("__r") and name != "rsub":  # (``x.__rtruediv__(c)`` is ``c / x``;
            args.reverse()  # ``rsub(x, c)`` is ``c - x`` already, as ATen's ``rsub``)
        of = [coef.get(a, [None] * k) if isinstance(a, Node) else [None] * k for a in args[:2]]
        if rule.kind is Kind.SUM_OF_TERMS:
            alpha = value(n.kwargs.get("alpha", 1))
            a, b = (of[1], of[0]) if name == "rsub" else (of[0], of[1])
            sign = -1.0 if name != "add" else 1.0
            coef[n] = [plus(x, times(times(y, alpha), sign)) for x, y in zip(a, b)]
        elif rule.kind is Kind.NEGATE:
            coef[n] = [times(x, -1.0) for x in of[0]]
        elif rule.kind is Kind.FACTOR:
            mine = 0 if args[0] in coef else 1
            if name == "div" and mine == 1:
                raise NoTail(f"{n.name} divides by a sum over the rows")
            op = operator.mul if name == "mul" else operator.truediv
            coef[n] = [times(x, value(args[1 - mine]), op) for x in of[mine]]
        elif rule.kind is Kind.SAME:  # pos, a conversion: the factor of its input
            coef[n] = of[0]
        else:
            raise NoTail(f"{n.name} ({name}) is {rule.kind.value}, not a step of an affine map")
    # A constant factor is made like the first reduction (a 0-d tensor on the call's
    # device): a factory without a device would make a host tensor, and moving it to a
    # GPU is a copy that syncs the host every step.
    like, f64 = env[tail.reductions[0]], {"dtype": torch.float64}
    return [c if isinstance(c, Node) else g.call_function(torch.full_like, (like, c or 0.0), f64)
            for c in coef[tail.loss]]


def _kinds(tail: LossTail) -> str:
    return ",".join(f"{op_name(r)}:{str(meta(r).dtype).removeprefix('torch.')}" for r in tail.reductions)


def _whole_example(node: Node, device: torch.device) -> torch.Tensor:
    """A 0-d tensor like the one ``lm_head_loss`` makes of ``node`` at run time."""
    v = meta(node)
    if isinstance(v, torch.Tensor):
        return torch.zeros((), dtype=v.dtype, device=device)
    return torch.zeros((), dtype=torch.float32 if isinstance(v, (float, torch.SymFloat)) else torch.int64,
                       device=device)


def _joined(body: GraphModule, n_rows: int, tail: LossTail) -> GraphModule:
    """``(*rows, *tail rows, *whole, *tail whole) -> (what the loss sums)``: a row-local
    region's body, then its loss tail's row part on its results (each flattened)."""
    g, env = Graph(), {}
    places = [p for p in body.graph.nodes if p.op == "placeholder"]
    rows = [g.placeholder(f"row{i}") for i in range(n_rows)]
    env.update(zip(tail.row_operands, (g.placeholder(f"tail_row{i}") for i in range(len(tail.row_operands)))))
    whole = [g.placeholder(f"whole{i}") for i in range(len(places) - n_rows)]
    env.update(zip(tail.whole, (g.placeholder(f"tail_whole{i}") for i in range(len(tail.whole)))))
    inner = dict(zip(places, [*rows, *whole]))
    for n in body.graph.nodes:
        if n.op == "output":
            results = [inner[r] for r in n.args[0]]
        elif n.op != "placeholder":
            inner[n] = g.node_copy(n, inner.__getitem__)
    for item, i in tail.items.items():
        env[item] = g.call_method("reshape", (results[i], -1))
    _copy_rows(g, tail, env)
    return GraphModule(torch.nn.Module(), g)
