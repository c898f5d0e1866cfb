"""Rows a mask leaves out of a vocab-parallel region's loss: the skip graph of its one-pass
call (``distributed/masked_stages.py``), read through the stages' bodies, the glue between
them and what reads the call's results.  See NOTE [vocab-parallel rows, the proof].
"""

# NOTE [vocab-parallel rows, the proof]
# The same two facts per node as the single-process rules (``match/row_mask.py``,
# ``match/body_mask.py``: exactly 0 / an interval holding the value; a zero cotangent / a
# bound on it), per row, at run time, on each rank:
#
# * the logits' interval is ``[-z, z]``, ``z`` the rank's bound with the largest weight
#   agreed over the ranks (``masked_stages``), and the op compacts only where every
#   shard has the same width: so every rank bounds each stage value in the same interval;
# * the glue: an all-reduce with MAX / MIN / AVG of such a value holds in its interval, a
#   SUM in it times the group's size; ``wait_tensor`` and per-row views pass facts on;
# * the readers: the same, and the straight-through spelling ``all_reduce(v.detach()) +
#   (v - v.detach())`` is the all-reduce where ``v`` is finite (``v - v.detach()`` is 0).
#
# Intervals alone lose the shifted logits (an FP32 ``exp`` past 88 is unknown), so two
# relations are kept:
#
# 1. a stage's ``x - m``, with ``m`` the all-reduced MAX of an earlier stage's
#    ``x'.amax(-1)`` and ``x'`` the same computation as ``x`` (op for op from the logits),
#    is at most 0 on every rank (``m`` is at least this rank's largest entry);
# 2. the all-reduced SUM of ``exp(x - m).sum(-1)`` is at least 1: the rank holding the
#    row's largest entry adds ``exp(0)``.
#
# A rank's facts about an all-reduce assume the other ranks' facts about their own
# operands; each rank's skip vector holds its own, and the op all-reduces them with MIN,
# so a row is left out only where all of them hold.  A skipped row's results are written
# inside their intervals (``rows.inside``), a sum of relation 2 as 1 (so the all-reduced
# sum is the group's size, its ``log`` finite, as the proof assumed).

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.fx import Graph, GraphModule, Node

from ..fx.graph_ops import is_collective, meta, op_name
from ..fx.placement import _draws
from ..kernels.ops import user_bodies
from ..kernels.rows import inside
from ..match.body_facts import _N, BodyExample, _body_backward, _BodyInterpreter, values_on
from ..match.loss_tail import LossTail
from ..match.masks import _column
from ..match.skip_graph import _Facts
from ..match.tail_facts import Value, _Interpreter, _NoRule, say_why
from .one_pass import OnePass, _glue_module

__all__ = ["StagesView", "view_of", "skip_rows_of_stages"]

_VIEWS = {"unsqueeze", "squeeze", "flatten", "view", "reshape", "view_as", "contiguous", "detach"}
_UNKNOWN: Value = (False, -math.inf, math.inf)


@dataclass
class StagesView:
    """What the skip graph reads of a one-pass plan, taken before the rewrite erases the
    region: each stage's body and its operands (``("ext", i)``: the plan's external ``i``;
    ``("red", (k, j))``: stage ``k``'s reduction ``j``; ``("glue", node)``: a node of
    ``glue``, the glue replayed, whose placeholders are ``glue_inputs``), the call's
    outputs, the stage with a gradient, each body's example inputs' specs."""
    bodies: list[GraphModule]
    operands: list[list[tuple]]
    glue: Optional[GraphModule]
    glue_inputs: list[tuple]
    outputs: list[tuple]
    grad: Optional[int]
    specs: list[list[tuple[torch.dtype, tuple, bool]]]  # per placeholder: dtype, shape, one value a row
    vocab: int
    externals: list[Node]  # the plan's (the call's arguments once it is in the graph)


def view_of(one: OnePass, stages: list, rows: int, logits: tuple[torch.dtype, int]) -> Optional[StagesView]:
    """The :class:`StagesView` of ``one`` (``stages``: each stage's ``reductions``,
    ``operands``, ``body`` and ``differentiable``; ``rows``: the region's; ``logits``: the
    logits shard's dtype and width), or None where an operand is not a tensor."""
    where: dict[Node, tuple] = {e: ("ext", i) for i, e in enumerate(one.externals)}
    for k, p in enumerate(stages):
        where.update({r: ("red", (k, j)) for j, r in enumerate(p.reductions)})
    glue, inputs = _glue_module(one.glue, one.read) if one.glue else (None, [])
    if glue is not None:
        out = next(iter(glue.graph.find_nodes(op="output"))).args[0]
        where.update({n: ("glue", g) for n, g in zip(one.glue, out)})
    if any(i not in where for i in inputs):
        return None
    specs, rows, width = [], _hint(rows), _hint(logits[1])
    for k, p in enumerate(stages):
        spec = [(logits[0], (rows, width), True)]
        for o in one.operands[k]:
            v = meta(o)
            if isinstance(v, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(v, bool):
                floating = isinstance(v, (float, torch.SymFloat))
                v = torch.empty((), dtype=torch.float32 if floating else torch.int64)
            if not isinstance(v, torch.Tensor) or o not in where:  # (a number: the call's 0-d tensor)
                return None
            shape = tuple(map(_hint, v.shape))
            spec.append((v.dtype, shape, len(shape) > 0 and shape[0] == math.prod(shape) == rows))
        specs.append(spec)
    grad = [k for k, p in enumerate(stages) if p.differentiable]
    return StagesView([p.body for p in stages], [[where[o] for o in ops] for ops in one.operands], glue,
                      [where[i] for i in inputs], [where[o] for o in one.outputs], grad[0] if grad else None,
                      specs, width, list(one.externals))


def _hint(d: Any) -> int:
    """A size, symbolic ones as their hints (the example's sizes only: the skip graph reads
    no size but the vocabulary's, ``width``, at run time)."""
    return int(d) if not isinstance(d, torch.SymInt) else int(d.node.hint or 2)


def _example(body: GraphModule, spec: list) -> dict[Node, Any]:
    """Each node's value on an example of ``_N`` rows (``body_facts._shapes``'s, in the
    body's own placeholder order)."""
    return values_on(body, [torch.zeros((_N, *s[1:]) if row else s, dtype=d) for d, s, row in spec])


def _strip(n: Any) -> Any:
    """``n`` through ``detach`` (the same value)."""
    while isinstance(n, Node) and op_name(n) == "detach" and len(n.args) == 1:
        n = n.args[0]
    return n


def _same(a: Any, b: Any, pa: list[Node], pb: list[Node], ra: list[tuple], rb: list[tuple]) -> bool:
    """Do ``a`` (of a body with placeholders ``pa``, operands ``ra``) and ``b`` compute the
    same value: op for op, with no random draw, from the logits or the same external?"""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, pa, pb, ra, rb) for x, y in zip(a, b))
    if not (isinstance(a, Node) and isinstance(b, Node)):
        return not isinstance(a, Node) and not isinstance(b, Node) and type(a) is type(b) and a == b
    a, b = _strip(a), _strip(b)
    if a.op == "placeholder" or b.op == "placeholder":
        if a.op != b.op:
            return False
        ia, ib = pa.index(a), pb.index(b)
        return (ia == ib == 0) or (ia > 0 and ib > 0 and ra[ia - 1] == rb[ib - 1] and ra[ia - 1][0] == "ext")
    if a.op not in ("call_function", "call_method") or a.op != b.op or a.target != b.target \
            or _draws(a) or set(a.kwargs) != set(b.kwargs):
        return False
    return _same(list(a.args), list(b.args), pa, pb, ra, rb) and \
        all(_same(a.kwargs[k], b.kwargs[k], pa, pb, ra, rb) for k in a.kwargs)


class _Reads(_Interpreter):
    """The readers' facts (``match/tail_facts._Interpreter``), with functional all-reduces,
    ``wait_tensor`` and the straight-through spelling (module NOTE)."""

    def __init__(self, f: _Facts, tail: LossTail, env: dict, sizes: dict[str, int],
                 sums: dict[Node, str]) -> None:
        super().__init__(f, tail, env)
        self.sizes, self.sums = sizes, sums  # (sums: the results relation 2 reads, and their group)

    def _collective(self, n: Node) -> Optional[tuple[str, Any, str, Any]]:
        """(name, operand, reduce op, group size) of a functional collective (None: not one)."""
        if not is_collective(n):
            return None
        name = op_name(n).split(".")[0]
        if name == "wait_tensor":
            return name, n.args[0], "", 1
        args = [*n.args, *n.kwargs.values()]
        if name != "all_reduce" or len(args) != 3 or args[2] not in self.sizes:
            raise _NoRule(f"{name} has no rule (or over a group the loop's collectives do not use)")
        return name, args[0], args[1], args[2]

    def _forward(self, n: Node) -> Value:
        f, c = self.f, self._collective(n)
        if c is not None:
            name, x, how, group = c
            v, lo, hi = self.value(x)
            if name == "wait_tensor" or how in ("max", "min", "avg"):
                return v, lo, hi
            if how != "sum":
                raise _NoRule(f"an all_reduce {how!r}")
            size = float(self.sizes[group])
            lo, hi = f.times(lo, size), f.times(hi, size)
            return v, f.high(lo, 1.0) if self.sums.get(_strip(x)) == group else lo, hi  # (relation 2)
        if op_name(n) == "sub" and len(n.args) == 2 and isinstance(n.args[1], Node) \
                and op_name(n.args[1]) == "detach" and n.args[1].args[:1] == (n.args[0],):
            finite = self.finite(n.args[0])  # (v - v.detach(): 0 where v is finite)
            return finite, f.select(finite, 0.0, -math.inf), f.select(finite, 0.0, math.inf)
        return super()._forward(n)

    def _backward(self, n: Node, z: Any, m: Any) -> list:
        c = self._collective(n)
        if c is not None:
            size = self.sizes[c[3]] if c[0] == "all_reduce" else 1
            return [(c[1], z, m if size == 1 else self.f.times(m, float(size)))]
        return super()._backward(n, z, m)


class _Builder:
    """The stage side of the skip graph: each stage's body interpreted in one graph."""

    def __init__(self, view: StagesView, sizes: dict[str, int]) -> None:
        self.view, self.sizes = view, sizes
        self.f = f = _Facts(Graph())
        self.width, self.z = f.g.placeholder("width"), f.g.placeholder("z")
        n_ext = 1 + max([r[1] for ops in view.operands for r in ops if r[0] == "ext"] + [-1])
        self.ext = [f.g.placeholder(f"input{i}") for i in range(n_ext)]
        self.facts: dict[tuple, Value] = {}  # ("red", (k, j)) -> its facts
        self.glue_facts: dict[Node, Value] = {}
        self.sums: dict[tuple, str] = {}  # reductions relation 2 reads -> the group of their max
        self.runs: list[_BodyInterpreter] = []
        self.unknown: list[str] = []

    def ref(self, r: tuple) -> Value:
        if r[0] == "red":
            return self.facts.get(r, _UNKNOWN)
        if r[0] == "glue":
            return self.glue(r[1])
        x = self.f.g.call_method("double", (self.f.g.call_method("reshape", (self.ext[r[1]], -1)),))
        return False, x, x

    def glue(self, n: Node) -> Value:
        if n not in self.glue_facts:
            self.glue_facts[n] = self._glue(n)
        return self.glue_facts[n]

    def _glue(self, n: Node) -> Value:
        if n.op == "placeholder":
            places = [p for p in self.view.glue.graph.nodes if p.op == "placeholder"]
            return self.ref(self.view.glue_inputs[places.index(n)])
        name = op_name(n).split(".")[0]
        if is_collective(n) and name == "wait_tensor" or name in _VIEWS or _column(n):
            return self.glue(n.args[0])
        reduced = is_collective(n) and name == "all_reduce" and len(n.args) == 3 and not n.kwargs
        if reduced and n.args[1] in ("max", "min", "avg"):
            return self.glue(n.args[0])
        if reduced and n.args[1] == "sum" and n.args[2] in self.sizes:
            v, lo, hi = self.glue(n.args[0])
            size = float(self.sizes[n.args[2]])
            return v, self.f.times(lo, size), self.f.times(hi, size)
        self.unknown.append(f"{n.name}: glue {name} has no rule")
        return _UNKNOWN

    def _top(self, k: int, i: int, places: list[Node]) -> Optional[tuple[Node, str]]:
        """Relation 1: the node ``x`` of stage ``k``'s body that its operand ``i`` (a
        placeholder) bounds from above on every rank, and the group of that MAX; or None."""
        r = self.view.operands[k][i - 1]
        if r[0] != "glue":
            return None
        n = r[1]
        while op_name(n) in ("unsqueeze", "squeeze", "view", "reshape") or _column(n):
            n = n.args[0]
        if not (is_collective(n) and op_name(n).split(".")[0] == "wait_tensor"):
            return None
        n = n.args[0]
        if not (is_collective(n) and op_name(n).split(".")[0] == "all_reduce" and len(n.args) == 3
                and n.args[1] == "max" and _strip(n.args[0]).op == "placeholder"):
            return None
        places_g = [p for p in self.view.glue.graph.nodes if p.op == "placeholder"]
        src = self.view.glue_inputs[places_g.index(_strip(n.args[0]))]
        if src[0] != "red":
            return None
        j, at = src[1]
        body_j = self.view.bodies[j]
        reduced = next(iter(body_j.graph.find_nodes(op="output"))).args[0][at]
        if op_name(reduced) != "amax" or reduced.args[1:] not in ((-1,), (-1, True), (1,), (1, True)):
            return None
        x0, places_j = reduced.args[0], [p for p in body_j.graph.nodes if p.op == "placeholder"]
        for user in places[i].users:
            ops = self.view.operands
            if op_name(user) == "sub" and len(user.args) == 2 and user.args[1] is places[i] \
                    and _same(x0, user.args[0], places_j, places, ops[j], ops[k]):
                return user.args[0], n.args[2]
        return None

    def stage(self, k: int) -> None:
        """Interpret stage ``k``'s body: the facts of its reductions."""
        f, view, body = self.f, self.view, self.view.bodies[k]
        places = [p for p in body.graph.nodes if p.op == "placeholder"]
        values = _example(body, view.specs[k])
        supplied = {places[i]: self.ref(r) for i, r in enumerate(view.operands[k], 1) if r[0] != "ext"}
        run = _BodyInterpreter(f, BodyExample(body, values, places[0], view.vocab), self.width, set(),
                               frozenset(supplied))
        for i, p in enumerate(places):
            if i == 0:
                run.env[p] = self.z
                run.input_place(p, self.z)
            elif p in supplied:
                run.facts[p] = supplied[p]
                top = self._top(k, i, places)
                if top is not None:
                    run.tops[p] = (f"group {top[1]}", top[0])
            else:
                run.env[p] = self.ext[view.operands[k][i - 1][1]]
                if p not in run.exact:
                    run.input_place(p, run.env[p])
        run.run_nodes(body)
        for j, r in enumerate(next(iter(body.graph.find_nodes(op="output"))).args[0]):
            self.facts[("red", (k, j))] = run.value(r) if r in run.inner else _UNKNOWN
            e = r.args[0] if op_name(r) == "sum" and r.args else None
            shifted = run.shifted.get(e.args[0], "") if isinstance(e, Node) and op_name(e) == "exp" else ""
            if shifted.startswith("group "):
                self.sums[("red", (k, j))] = shifted[len("group "):]
        self.unknown += run.unknown
        self.runs.append(run)


def skip_rows_of_stages(view: StagesView, tail: LossTail, sizes: dict[str, int],
                        why: Optional[list[str]] = None) -> Optional[tuple[str, list[Node]]]:
    """The skip graph of a one-pass call whose results ``tail`` reads
    (``match_region_reads(.., collectives=True)``): ``skip(width, z, *inputs, *operands)
    -> (bool [rows], fill_0, ..)``, True where every value the readers read is exactly 0
    whatever each result holds in its interval and the stage with a gradient gives the
    logits an exactly-zero gradient (NOTE [vocab-parallel rows, the proof]; ``sizes``: the
    process groups' sizes by name).  Returns its key and the nodes it reads (the plan's
    externals, then the tail's operands), or None (the reason appended to ``why``)."""
    b = _Builder(view, sizes)
    try:
        for k in range(len(view.bodies)):
            b.stage(k)
    except Exception as e:  # noqa: BLE001 - a body that does not run on the example: every row runs
        if why is not None:
            why.append(f"the skip graph could not read the stages' bodies ({type(e).__name__}: {e})")
        return None
    f, g = b.f, b.f.g
    items = [b.facts.get(r, _UNKNOWN) if r[0] == "red" else b.glue(r[1]) for r in view.outputs]
    operands = [*tail.row_operands, *tail.whole]
    env: dict[Node, Node] = {}
    places = {}
    for i, o in enumerate(operands):
        places[o] = g.placeholder(f"operand{i}")
        v = meta(o)
        per_row = isinstance(v, torch.Tensor) and v.dim() > 0
        env[o] = g.call_method("reshape", (places[o], -1)) if per_row else places[o]
    sums = {item: b.sums[view.outputs[i]] for item, i in tail.items.items() if view.outputs[i] in b.sums}
    reads = _Reads(f, tail, env, sizes, sums)
    leaving = [n for n in tail.leaving if n in reads.inner]
    skip = reads.forward([], leaving, items)
    if skip is not False:
        reads.backward([1.0] * len(tail.reductions), leaving)
        k = view.grad
        if k is not None:
            results = next(iter(view.bodies[k].graph.find_nodes(op="output"))).args[0]
            mine = {item: view.outputs[i][1][1] for item, i in tail.items.items()
                    if view.outputs[i][0] == "red" and view.outputs[i][1][0] == k}
            seeds = [(results[j], *reads.cotangents[item]) for item, j in mine.items()]
            skip = f.and_(skip, _body_backward(b.runs[k], view.bodies[k], seeds).get(b.runs[k].logits, True))
    if skip is False:
        say_why(reads, leaving, why, b.unknown, False)
        return None
    fills = []
    for r, (_, lo, hi) in zip(view.outputs, items):
        dtype = _dtype(view, r)
        fill = g.call_function(inside, (f.high(lo, 1.0) if r in b.sums else lo, hi, dtype))
        skip = f.and_(skip, f.call(operator.getitem, fill, 1))
        fills.append(f.call(operator.getitem, fill, 0))
    g.output((f.and_(skip, f.call(torch.isfinite, b.z)), *fills))
    read = [e for e, p in zip(view.externals, b.ext) if p.users]
    read += [o for o in operands if places[o].users]
    for p in [*b.ext, *places.values()]:
        if not p.users:
            g.erase_node(p)
    return user_bodies.register(GraphModule(torch.nn.Module(), g)), read


def _dtype(view: StagesView, r: tuple) -> torch.dtype:
    """The dtype of the call's output ``r`` (from the example run of its body / glue)."""
    if r[0] == "red":
        k, j = r[1]
        body = view.bodies[k]
        out = next(iter(body.graph.find_nodes(op="output"))).args[0][j]
        return _example(body, view.specs[k])[out].dtype
    return torch.float32 if r[1].meta.get("val") is None else r[1].meta["val"].dtype
