"""A fused vocab-parallel region's stages in one pass over the rows: each row chunk's
logits are computed once in the forward, not once per stage.

Contract: ``shard_lm_head_stages(plan, train, budget, h, w, *operands)`` returns what the
per-stage :func:`~fx_passes.kernels.log_softmax.shard.shard_lm_head` calls and the *glue*
between them (all-reduces of per-row values, ``wait_tensor``, views that keep the rows)
returned, with the same values: every op is the user's, on the same elements.  Only glue
that is per row and needs no gradient moves into the loop; anything else (an in-place
``dist.all_reduce`` is a ``copy_``) keeps one call per stage, and the log says why.  The
collectives run once per row chunk on every rank alike: ranks agree on the chunk count
once per shape (:func:`_agreed`).  The backward is the stage with a
gradient's, unchanged, with its glue operands saved from the forward.  See NOTE [one
pass over the rows] for the before/after graphs.
"""

# NOTE [one pass over the rows]
# With the lm_head fused each stage of a region (fx_passes.distributed.shard_stages)
# computes every row chunk's logits again, because its per-row operands (the all-reduced
# max) exist only after the previous stage has seen all rows.  But the glue between the
# stages is per row, so one loop over row chunks computes a chunk's logits once and runs
# stage 0, the glue on the chunk's rows (its collectives on [rows] tensors), stage 1, ...
# One GEMM in the forward instead of one per stage.  Before (two stages):
#
#     amax = shard_lm_head("<key0>", False, budget, h, w)[0]
#     m    = wait_tensor(all_reduce(amax, "max", group)).unsqueeze(-1)
#     out  = shard_lm_head("<key1>", True, budget, h, w, m, idx)
#
# After:
#
#     out = shard_lm_head_stages("<plan>", True, budget, h, w, idx)   # the glue runs inside
#     s, tgt = out[1], out[2]                                         # out[3]: m, saved

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.fx import Graph, GraphModule, Node

from .. import compat
from ..fx.graph_ops import is_collective, is_elementwise, meta
from ..fx.placement import changes_state
from ..kernels.log_softmax.shard import row_chunks, shard_lm_head_backward
from ..kernels.ops import user_bodies
from ..kernels.ops.args import args_by_name, grads_by_name
from ..kernels.ops.pair import call_by_name, grads_or_zeros, keep_result_specs, save_inputs, saved_inputs
from ..kernels.ops.registry import CUDAGRAPH_UNSAFE, ONE_PASS_PLANS, UNSAFE, emitted
from ..kernels.tiling import CPU_BUDGET, backward_plan, even_splits, resolve_budget, sweep_sizes
from ..reporting.report import Decline, Reason
from .shard_regions import needs_grad

__all__ = ["OnePass", "plan_one_pass", "shard_lm_head_stages"]

# Views a glue node may take of a per-row vector (its rows stay its rows: numel == T),
# whatever the number of rows; "view" / "reshape" only to (-1,) or (-1, 1) (_row_view).
# Not match.upcast.ROW_VIEWS (views of [.., V] logits that keep each row's V entries),
# nor fx.placement's views (anything that may share storage).
_PER_ROW_VIEWS = {"unsqueeze", "squeeze", "flatten", "view_as", "contiguous"}


def _row_view(node: Node) -> bool:
    """``x.view(-1, 1)``, ``x.reshape(-1)``: no size of its own (a size such as
    ``view(T, 1)`` is wrong for a chunk of rows)."""
    if node.op != "call_method" or node.target not in ("view", "reshape") or node.kwargs:
        return False
    shape = node.args[1:]
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return list(shape) in ([-1], [-1, 1])


@dataclass
class OnePass:
    """What the rewrite needs: the graph values the loop reads (``externals``), the glue
    nodes it runs (graph order), the op's outputs (nodes whose uses it takes over), each
    stage's operands as the loop sees them (``operands``), and ``read(reader, node)``:
    the node whose value ``reader`` sees when it reads ``node`` (see :func:`_copies`)."""
    externals: list[Node]
    glue: list[Node]
    outputs: list[Node]
    operands: list[list[Node]]
    read: Callable[[Node, Node], Node]


def _row_wise(node: Node, rows: int) -> Optional[str]:
    """Why glue ``node`` cannot run on a chunk of rows (None when it can)."""
    v = meta(node)
    if not isinstance(v, torch.Tensor) or v.dim() < 1 or v.shape[0] != rows or v.numel() != rows:
        return f"{node.name} is not one value per row"
    if v.requires_grad:
        return f"{node.name} needs a gradient"
    if changes_state(node):
        return f"{node.name} ({node.target}) mutates or switches a mode"
    if is_collective(node):
        name = getattr(node.target, "__name__", str(node.target))
        return None if name.split(".")[0] in ("all_reduce", "wait_tensor") else f"{node.name} is {name}"
    per_row_view = node.op == "call_method" and node.target in _PER_ROW_VIEWS
    if is_elementwise(node) or per_row_view or _row_view(node):
        return None
    return f"{node.name} ({node.target}) is not an elementwise op"


def _copies(graph: Graph, reductions: set[Node], order: dict[Node, int]) -> Callable[[Node, Node], Node]:
    """Megatron's in-place ``dist.all_reduce(m)`` on a reduction's result is, in Dynamo's
    graph, ``m.copy_(wait_tensor(all_reduce(m, ..)))``: nodes after the ``copy_`` that
    read ``m`` see the all-reduced value.  The ``copy_`` stays in the graph (on the op's
    output, for the readers outside); inside the loop its readers read the source.
    Returns that ``read``; Decline on any other mutation between the first and the
    last reduction."""
    first, last = min(order[r] for r in reductions), max(order[r] for r in reductions)
    copies: dict[Node, Node] = {}
    for n in graph.nodes:
        if not (first < order[n] < last and changes_state(n)):
            continue
        dst, src = (n.args + (None, None))[:2]
        if (n.op == "call_method" and n.target == "copy_" and not n.kwargs and len(n.args) == 2
                and dst in reductions and dst not in copies and isinstance(src, Node)
                and isinstance(meta(src), torch.Tensor) and meta(src).shape == meta(dst).shape
                and meta(src).dtype == meta(dst).dtype):
            copies[dst] = n
            continue
        raise Decline(Reason.ORDER, f"{n.name} ({n.target}) runs between the stages")

    def read(reader: Node, node: Node) -> Node:
        c = copies.get(node)
        return c.args[1] if c is not None and order[reader] > order[c] else node
    return read


def plan_one_pass(region, stages: list[tuple[list[Node], list[Node]]], rows: int,
                  order: dict[Node, int]) -> OnePass:
    """The one-pass plan of ``region``'s ``stages`` (each ``(reductions, operands)``;
    ``order``: each graph node's position), or Decline (the caller keeps one call per
    stage)."""
    graph = region.upcast.graph
    reductions = {r for red, _ in stages for r in red}
    read = _copies(graph, reductions, order)
    readers = set(region.nodes) | reductions
    operands = []
    for _, ops in stages:  # as the stage's own nodes see them
        operands.append([])
        for o in ops:
            seen = {read(u, o) for u in o.users if u in readers}
            if len(seen) > 1:
                raise Decline(Reason.ORDER, f"{o.name} is read before and after it is changed in place")
            operands[-1].append(seen.pop() if seen else o)
    memo: dict[Node, bool] = {}

    def depends(n: Node) -> bool:  # on a reduction
        if n not in memo:
            memo[n] = n in reductions or any(depends(read(n, a)) for a in n.all_input_nodes)
        return memo[n]
    # glue: the nodes between a reduction and a later stage's operand
    glue: set[Node] = set()
    stack = [o for ops in operands for o in ops if depends(o) and o not in reductions]
    while stack:
        n = stack.pop()
        if n not in glue:
            glue.add(n)
            inputs = [read(n, a) for a in n.all_input_nodes]
            stack += [a for a in inputs if depends(a) and a not in reductions]
    externals: list[Node] = []
    for n in sorted(glue, key=order.__getitem__):
        why = _row_wise(n, rows)
        if why:
            raise Decline(Reason.UNKNOWN_OP, f"glue between stages: {why}")
        for a in (read(n, a) for a in n.all_input_nodes):
            if a in glue or a in reductions or a in externals:
                continue
            va = meta(a)
            per_row = isinstance(va, torch.Tensor) and (va.dim() == 0 or (va.shape[0] == va.numel() == rows))
            if isinstance(va, torch.Tensor) and not per_row:
                raise Decline(Reason.UNKNOWN_OP, f"glue {n.name} reads {a.name}, not one value per row")
            externals.append(a)
    for o in (o for ops in operands for o in ops):
        if o not in glue and o not in reductions and o not in externals:
            externals.append(o)
    inside = set(region.nodes) | reductions | glue
    outputs = [r for red, _ in stages for r in red]
    outputs += [g for g in sorted(glue, key=order.__getitem__) if any(u not in inside for u in g.users)]
    for (red, _), ops in zip(stages, operands):  # the stage with a gradient: its glue operands
        if any(needs_grad(r) for r in red):
            outputs += [o for o in ops if o in glue and o not in outputs]
    return OnePass(externals, sorted(glue, key=order.__getitem__), outputs, operands, read)


# --- the run-time plan ---------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    """Steps over a list of values (the chunk's externals first): ``("stage", key, refs)``
    appends the stage's reductions, ``("glue", gm, refs)`` the glue's outputs.
    ``outputs`` are refs; ``grad`` is the stage with a gradient: its key, its operands
    (``("in", i)`` external i, ``("out", j)`` output j) and the positions of its
    reductions among the outputs."""
    steps: tuple
    outputs: tuple[int, ...]
    grad: Optional[tuple[str, tuple[tuple[str, int], ...], tuple[int, ...]]]
    groups: tuple[str, ...]  # the process groups of the glue's collectives


def register(one: OnePass, reductions: list[list[Node]], keys: list[str]) -> str:
    """The key of the run-time plan of ``one`` (``reductions`` and ``keys``: each
    stage's reductions and body)."""
    refs: dict[Node, int] = {e: i for i, e in enumerate(one.externals)}
    glue, steps, desc = set(one.glue), [], []
    for k, (reds, operands, key) in enumerate(zip(reductions, one.operands, keys)):
        if k > 0:  # the glue this stage's operands need that is not computed yet
            need = [g for g in one.glue if g not in refs and _feeds(g, operands, glue, one.read)]
            gm, inputs = _glue_module(need, one.read)
            steps.append(("glue", gm, tuple(refs[i] for i in inputs)))
            desc.append(gm.code + repr(steps[-1][2]))
            base = len(refs)
            for i, g in enumerate(need):
                refs[g] = base + i
        steps.append(("stage", key, tuple(refs[o] for o in operands)))
        desc.append(key + repr(steps[-1][2]))
        base = len(refs)
        for i, r in enumerate(reds):
            refs[r] = base + i
    outputs = tuple(refs[o] for o in one.outputs)
    grad = None
    for reds, operands, key in zip(reductions, one.operands, keys):
        if any(needs_grad(r) for r in reds):
            where = tuple(("in", one.externals.index(o)) if o in one.externals else
                          ("out", one.outputs.index(o)) for o in operands)
            grad = (key, where, tuple(one.outputs.index(r) for r in reds))
    groups = tuple(sorted({_group(g) for g in one.glue if _group(g) is not None}))
    plan = _Plan(tuple(steps), outputs, grad, groups)
    name = hashlib.sha256("".join(desc + [repr(outputs), repr(grad), repr(groups)]).encode()).hexdigest()[:24]
    ONE_PASS_PLANS.add(name, plan)
    return name


def _group(node: Node) -> Optional[str]:
    """The process group (its name) of a functional all-reduce node, else None."""
    name = getattr(node.target, "__name__", "")
    if node.op != "call_function" or name.split(".")[0] != "all_reduce":
        return None
    group = node.kwargs.get("group_name", node.args[2] if len(node.args) > 2 else None)
    return group if isinstance(group, str) else None


def _feeds(g: Node, operands: list[Node], glue: set[Node], read) -> bool:
    """Is glue ``g`` an ancestor (through glue) of one of ``operands``?"""
    stack, seen = [o for o in operands if o in glue], set()
    while stack:
        n = stack.pop()
        if n is g:
            return True
        if n not in seen:
            seen.add(n)
            stack += [read(n, a) for a in n.all_input_nodes if read(n, a) in glue]
    return False


def _glue_module(nodes: list[Node], read) -> tuple[GraphModule, list[Node]]:
    """``fn(*inputs) -> tuple(nodes)``: the glue ``nodes`` replayed; ``inputs`` are the
    values computed before them that they read."""
    g, env, inputs = Graph(), {}, []
    for n in nodes:
        for a in (read(n, a) for a in n.all_input_nodes):
            if a not in env and a not in nodes:
                env[a] = g.placeholder(f"in{len(inputs)}")
                inputs.append(a)
    for n in nodes:
        env[n] = g.node_copy(n, lambda a, n=n: env[read(n, a)])
    g.output(tuple(env[n] for n in nodes))
    return GraphModule(torch.nn.Module(), g), inputs


def _run(plan: _Plan, x: torch.Tensor, externals: list[torch.Tensor], body) -> list[torch.Tensor]:
    vals = list(externals)
    for kind, what, refs in plan.steps:
        args = [vals[r] for r in refs]
        vals += list(body(what)(x, *args) if kind == "stage" else what(*args))
    return [vals[r] for r in plan.outputs]


# (plan, groups, their objects' ids, this rank's width and budget) -> (the agreed width
# and budget, the group objects: held, so their ids are not reused while the entry lives)
_AGREED: dict[tuple, tuple[tuple[int, int], tuple]] = {}


def _agreed(name: str, groups: tuple[str, ...], width: int, budget: int,
            device: torch.device) -> tuple[int, int]:
    """(the largest shard width, the smallest budget) over the ranks of ``groups``: an
    all-reduce and a host read in plan ``name``'s first call on these group objects with
    this width and budget (the warm-up step), a dict look-up after.  Every rank must miss
    together: two plans of one name on the same groups whose widths are equal on one rank
    and not on another would not (not expected: the name hashes the plan's code)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    objects = tuple(_resolve_process_group(g) for g in groups)
    key = (name, groups, tuple(map(id, objects)), width, budget)
    if key not in _AGREED:
        if compat._capturing(device.type):
            raise RuntimeError("chunked_logits: the vocab-parallel one-pass loop agrees on its row chunks "
                               "with the other ranks in its first call: run a step before capturing a graph")
        collectives, mine = torch.ops._c10d_functional, torch.tensor([width, -budget], device=device)
        for group in groups:
            mine = collectives.wait_tensor(collectives.all_reduce(mine, "max", group))
        most, least = mine.tolist()
        _AGREED[key] = ((most, -least), objects)
    return _AGREED[key][0]


def _splits(name: str, hidden, weight, budget_bytes: int) -> list[tuple[int, int]]:
    """The row chunks, the same on every rank of plan ``name``'s groups: vocabulary shards
    may differ in width (1000 and 1400 columns), so each rank chunks as the widest shard
    with the smallest budget would (the count grows with the width, shrinks with the
    budget: each rank within its budget).  Those two are agreed once (:func:`_agreed`);
    the rows are the same on every rank, so later calls agree with no collective and no
    host read (docs/gpu.md, "Host syncs")."""
    n, width = hidden.shape[0], weight.shape[0]
    budget = resolve_budget(budget_bytes, hidden.device) or CPU_BUDGET
    groups = ONE_PASS_PLANS[name].groups
    if groups:
        width, budget = _agreed(name, groups, width, budget, hidden.device)
    rows, _ = sweep_sizes(budget, n, width)
    count = len(even_splits(n, rows))
    return even_splits(n, -(-n // count))


def _forward(name: str, hidden, weight, externals, budget_bytes: int,
             into: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """The plan's outputs (``into``: a ``[N, V / world]`` buffer the chunks' logits are
    written into, ``kept_stages``)."""
    plan = ONE_PASS_PLANS[name]
    outs = row_chunks(hidden, weight, externals, _splits(name, hidden, weight, budget_bytes),
                      lambda x, *chunk: _run(plan, x, list(chunk), user_bodies.body), into)
    return outs if outs is not None else _fake(name, hidden, weight, externals, budget_bytes)


def _fake(name: str, hidden, weight, externals, budget_bytes: int, plan: str = "auto") -> list[torch.Tensor]:
    backward_plan(hidden.device, hidden.dtype, plan)  # (its one-time probe at compile time, not in a step)
    x = hidden.new_empty(hidden.shape[0], weight.shape[0])
    got = _run(ONE_PASS_PLANS[name], x, list(externals), user_bodies.fake_function)
    return [torch.empty_like(g, memory_format=torch.contiguous_format) for g in got]


@torch.library.custom_op("chunked_logits::shard_lm_head_stages", mutates_args=(), tags=UNSAFE)
def _stages(name: str, hidden: torch.Tensor, weight: torch.Tensor, externals: list[torch.Tensor],
            budget_bytes: int, plan: str) -> list[torch.Tensor]:
    return _forward(name, hidden, weight, externals, budget_bytes)


_stages.register_fake(_fake)


def save_for_stages(ctx, op, inputs, output, extra: int = 0) -> None:
    """``setup_context`` of a one-pass op ``op`` whose last ``extra`` results are its own
    (not the plan's): its inputs, the plan's results that the stage with a gradient reads,
    and those ``extra`` results, for :func:`stages_backward`."""
    plan = ONE_PASS_PLANS[args_by_name(op, inputs)["name"]]
    _, where, _ = plan.grad or (None, (), ())
    outputs = output[:len(output) - extra]
    saved = [outputs[i] for kind, i in where if kind == "out"]  # (never one the graph changes in place)
    args = save_inputs(ctx, op, inputs, extra=[*saved, *output[len(outputs):]])
    keep_result_specs(ctx, outputs)
    ctx.needs = {"need_hidden": args["hidden"].requires_grad, "need_weight": args["weight"].requires_grad}


def stages_backward(ctx, grads, op, backward_op, extra_names: tuple[str, ...] = ()) -> dict:
    """The gradients (by name) of a one-pass op ``op`` saved by :func:`save_for_stages`:
    ``backward_op`` called by name with the stage with a gradient's key and operands, the
    incoming gradients of its reductions, and the saved extra results as ``extra_names``."""
    args, saved = saved_inputs(ctx)
    key, where, positions = ONE_PASS_PLANS[args["name"]].grad
    outputs, extras = iter(saved[:len(saved) - len(extra_names)]), saved[len(saved) - len(extra_names):]
    operands = [args["externals"][i] if kind == "in" else next(outputs) for kind, i in where]
    gh, gw = call_by_name(backward_op, args, key=key, operands=operands, **dict(zip(extra_names, extras)),
                          grads=grads_or_zeros(ctx, grads, args["hidden"].device, positions), **ctx.needs)
    return grads_by_name(op, ctx.lengths, hidden=gh if ctx.needs["need_hidden"] else None,
                         weight=gw if ctx.needs["need_weight"] else None)


def _setup(ctx, inputs, output):
    save_for_stages(ctx, _stages, inputs, output)


def _backward(ctx, grads):
    return stages_backward(ctx, grads, _stages, shard_lm_head_backward)


_stages.register_autograd(_backward, setup_context=_setup)


@emitted(("shard_lm_head_stages",), CUDAGRAPH_UNSAFE)
def shard_lm_head_stages(name: str, differentiable: bool, budget_bytes: int, hidden: torch.Tensor,
                         weight: torch.Tensor, *externals: torch.Tensor, plan: str = "auto"):
    """All stages of a rewritten vocab-parallel region whose logits shard is
    ``hidden @ weight.T``, in one pass over row chunks (see the module doc); ``plan``:
    ``Config.lm_head_plan``, the backward's (``shard.backward_loops``)."""
    if not differentiable:
        hidden, weight = hidden.detach(), weight.detach()
    return tuple(_stages(name, hidden, weight, [e.detach() for e in externals], budget_bytes, plan))


def getitems(graph: Graph, call: Node, nodes: list[Node]) -> None:
    """Point the uses of ``nodes`` (the op's outputs) at ``call``'s items."""
    for i, n in enumerate(nodes):
        item = graph.call_function(operator.getitem, (call, i))
        item.meta.update(n.meta)
        n.replace_all_uses_with(item)
