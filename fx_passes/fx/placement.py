"""Where a fused op may run: the one rule every rewrite obeys.

A rewrite replaces the nodes it absorbs by one op at one place, the *anchor*.  The op
computes what those nodes computed only if it sees what they saw: the same operand
versions (:func:`first_mutation`, else ``MUTATION``), the same autocast and
inference-mode state and, as far as it shows, the same grad mode (``STATE``);
:func:`check_placement` says which results to detach.  :func:`states` replays the graph's
mode switches in graph order.  See NOTE [placement].
"""

# NOTE [placement]
# A rewrite replaces nodes that ran at several places of the graph (from the earliest
# node it absorbs, the lm_head matmul and its transforms included, to its last sink) by
# one op at one place, the *anchor*.  The op computes what those nodes computed only if
# it sees what they saw:
#
# * **the same operand versions:** no in-place op runs between the first absorbed node
#   and the last one (nor before a hoisted index node): it could change an operand, or a
#   view of one, that the original read before the change and the op reads after it.
#   Checked with :func:`first_mutation`; a region that fails is declined (``MUTATION``).
# * **the same autocast and inference-mode state:** every absorbed node and the anchor
#   run inside the same open ``autocast`` / ``inference_mode`` blocks (``STATE``).
# * **the same grad mode, as far as it shows:** a value's grad mode only decides whether
#   it requires grad.  The replacement of each result must require grad exactly when the
#   original did (Dynamo's example values record it): a result the original computed
#   under ``no_grad`` is detached, and a result that needs a gradient the op at the anchor
#   cannot give is declined (``STATE``).  :func:`check_placement` says which results to
#   detach.
#
# Grad mode and autocast switches show in a Dynamo graph as calls
# (``torch._C._set_grad_enabled``, ``_enter_autocast`` / ``_exit_autocast``,
# ``_enter_inference_mode`` / ``_exit_inference_mode``); :func:`states` replays them in
# graph order.  The single-process rewrite (:mod:`fx_passes.rewrite.upcast_region`) and the
# vocab-parallel one (:mod:`fx_passes.distributed.shard_stages`) both call this module.

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Iterable, Optional

import torch
from torch.fx import Graph, Node

from ..reporting.report import Decline, Reason
from .graph_ops import (
    GRAD_SWITCH,
    MODE_CLOSERS,
    MODE_OPENERS,
    attribute_view,
    call_name,
    is_collective,
    is_mode_switch,
    mutates,
    requires_grad,
)

__all__ = ["State", "states", "changes_state", "writes_in_place", "first_mutation",
           "check_placement", "same_state", "view_family", "mutation_of", "movable_before"]


def writes_in_place(node: Node) -> bool:
    """:func:`mutates`, less the functional collectives: FX marks them impure (so the
    single-process matcher, which knows nothing of ranks, leaves a region holding one
    alone), but each writes only its own output, which is what the vocab-parallel
    matcher, for which they are stage boundaries, needs to know."""
    return mutates(node) and not is_collective(node)


def changes_state(node: Node) -> bool:
    """:func:`writes_in_place` or :func:`is_mode_switch`."""
    return writes_in_place(node) or is_mode_switch(node)


_VIEW_METHODS = {"view", "reshape", "unsqueeze", "squeeze", "transpose", "t", "permute", "expand", "flatten",
                 "narrow", "select", "detach", "as_strided", "view_as", "contiguous", "__getitem__",
                 "unflatten", "split", "chunk", "unbind", "movedim", "swapaxes", "diagonal", "unfold",
                 "expand_as"}
_VIEW_FUNCTIONS = {operator.getitem, torch.reshape, torch.flatten, torch.transpose, torch.squeeze,
                   torch.unsqueeze, torch.narrow, torch.select, torch.t, torch.permute, torch.detach,
                   torch.split, torch.chunk, torch.unbind, torch.movedim, torch.swapaxes, torch.diagonal}


def _is_view(node: Node) -> bool:
    """May ``node`` share its first argument's storage (a view, or an op that may return one)?"""
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op == "call_function":
        return node.target in _VIEW_FUNCTIONS or attribute_view(node) is not None
    return False


def view_family(node: Node) -> set[Node]:
    """Every node that may share ``node``'s storage through views: up to its base, then
    down every chain of views (they share one version counter)."""
    base = node
    while _is_view(base) and base.args and isinstance(base.args[0], Node):
        base = base.args[0]
    family, stack = {base}, [base]
    while stack:
        for u in stack.pop().users:
            if _is_view(u) and u.args and u.args[0] in family and u not in family:
                family.add(u)
                stack.append(u)
    return family


def mutation_of(graph: Graph, nodes: Iterable[Node], after: Node) -> Optional[Node]:
    """The first node after ``after`` that changes in place a tensor of the view family
    of one of ``nodes``, or None.  (A fused op that saves such a tensor for its backward
    would fail there, where the original saved none.)"""
    family = set().union(*(view_family(n) for n in nodes if isinstance(n, Node)))
    seen = False
    for n in graph.nodes:
        if seen and mutates(n) and any(a in family for a in n.all_input_nodes):
            return n
        seen = seen or n is after
    return None


@dataclasses.dataclass(frozen=True)
class State:
    """What a node runs under: the grad mode set by the last switch before it ("entry"
    before any), and the autocast / inference-mode blocks open around it."""

    grad: Any  # "entry", True or False
    blocks: tuple  # ((kind, args, opening node), ...) outermost first


def states(graph: Graph) -> tuple[dict[Node, State], Optional[bool]]:
    """Each node's :class:`State`, and the grad mode the graph was entered with when a
    switch shows it (Dynamo emits a switch only when it changes the mode, so the first
    one sets the opposite of the entry mode), else None."""
    grad: Any = "entry"
    entry: Optional[bool] = None
    blocks: list = []
    out: dict[Node, State] = {}
    for n in graph.nodes:
        out[n] = State(grad, tuple(blocks))
        if n.op != "call_function":
            continue
        if n.target is GRAD_SWITCH and n.args and isinstance(n.args[0], bool):
            entry = (not n.args[0]) if entry is None else entry
            grad = n.args[0]
        elif call_name(n) in MODE_OPENERS:
            blocks.append((MODE_OPENERS[call_name(n)], tuple(repr(a) for a in n.args), n))
        elif call_name(n) in MODE_CLOSERS and blocks:
            opened = n.args[0] if n.args else None
            blocks = [b for b in blocks if b[2] is not opened] if isinstance(opened, Node) else blocks[:-1]
    return out, entry


def same_state(graph: Graph, nodes: Iterable[Node]) -> None:
    """Decline (``STATE``) unless ``nodes`` all run under one grad mode and the same
    autocast / inference_mode blocks (the vocab-parallel rewrite's rule: it detaches
    nothing)."""
    state, _ = states(graph)
    nodes = list(nodes)
    for n in nodes[1:]:
        if state[n] != state[nodes[0]]:
            raise Decline(Reason.STATE, f"{n.name} runs under grad mode {state[n].grad} and "
                          f"{_describe(state[n])}, {nodes[0].name} under grad mode {state[nodes[0]].grad} "
                          f"and {_describe(state[nodes[0]])}")


def _draws(node: Node) -> bool:
    """Does ``node`` draw random numbers (moving it past another draw changes both)?"""
    name = call_name(node) if node.op == "call_function" else str(node.target)
    return "dropout" in name or name.startswith("rand") or name in ("bernoulli", "multinomial", "normal",
                                                                     "uniform", "bernoulli_", "normal_")


def movable_before(graph: Graph, before: Node, read: Iterable[Node],
                   avoid: frozenset = frozenset()) -> "list[Node] | str":
    """The nodes to move before ``before`` (in order) so that ``read`` are computed before
    it: ``read`` and what they read that is computed after it (a mask's ``.float()``,
    ``mask[:, None]``), each a call with no side effect and no random draw, inside
    ``before``'s autocast / inference-mode blocks and, when it reads a value that takes a
    gradient, under its grad mode, none reading a node of ``avoid`` (a region whose
    results they would then read before they exist), none of their inputs changed in
    place in between; else why not.  Moving them is exact: each computes the same value
    from the same inputs."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    state, _ = states(graph)
    moved: dict[Node, None] = {}

    def visit(n: Node) -> Optional[str]:
        if n in avoid:
            return f"it reads {n.name}, which the region computes or which reads its result"
        if n is before:
            return f"it reads {n.name}, where the region's call goes"
        if order[n] < order[before] or n in moved:
            return None
        if n.op not in ("call_function", "call_method") or mutates(n) or is_mode_switch(n) or _draws(n):
            return f"{n.name} cannot move (a side effect, a random draw, or not a call)"
        if state[n].blocks != state[before].blocks or (  # (a grad mode matters to what takes a gradient)
                state[n].grad != state[before].grad and any(requires_grad(a) for a in n.all_input_nodes)):
            return f"{n.name} runs under another grad mode or block than {before.name}"
        for a in n.all_input_nodes:
            why = visit(a)
            if why is not None:
                return why
        for a in n.all_input_nodes:  # (through a view of it too)
            writers = (u for v in view_family(a) for u in v.users)
            if any(order[before] < order[u] < order[n] and mutates(u) for u in writers):
                return f"{a.name}, which {n.name} reads, changes in place in between"
        moved[n] = None
        return None
    for o in read:
        why = visit(o)
        if why is not None:
            return why
    return list(moved)


def first_mutation(graph: Graph, start: Node, end: Node,
                   allowed: Callable[[Node], bool] = lambda n: False) -> Optional[Node]:
    """The first node strictly between ``start`` and ``end`` (graph order) that
    :func:`mutates` and is not ``allowed``, or None."""
    inside = False
    for n in graph.nodes:
        if n is end:
            return None
        if inside and mutates(n) and not allowed(n):
            return n
        inside = inside or n is start
    return None


def _describe(state: State) -> str:
    return " and ".join(kind for kind, _, _ in state.blocks) or "no autocast or inference_mode block"


def check_placement(graph: Graph, absorbed: Iterable[Node], anchor: Node, results: Iterable[Node],
                    inputs: Iterable[Any], last: Node, saved: Iterable[Node] = (),
                    replays_grad_modes: bool = False) -> set[Node]:
    """Check that one op at ``anchor`` may replace ``absorbed`` (raises Decline) and
    return the ``results`` whose replacements must be detached.

    ``results``: the original nodes whose values the op's outputs replace (their
    example values say whether they required grad); ``inputs``: the tensors the op
    reads that can carry a gradient; ``last``: the last node the op's reads stand for
    (the last absorbed node, or a later index node the rewrite hoists); ``saved``: the
    tensors the op saves for its backward when the original saved none of them (no
    in-place change of them may follow); ``replays_grad_modes``: the op replays the
    absorbed nodes themselves, detaching what each computed without grad (a row-local
    body), so only the anchor's grad mode matters, not each step's."""
    absorbed = list(absorbed)
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(absorbed, key=order.__getitem__)
    end = max([*absorbed, anchor, last], key=order.__getitem__)
    changed = first_mutation(graph, first, end)
    if changed is not None:
        what = getattr(changed.target, "__name__", changed.target)
        raise Decline(Reason.MUTATION, f"{changed.name} ({what}) runs between {first.name} and {end.name}")
    # (the op runs before the anchor: when the anchor is the latest, it comes after the op)
    changed = mutation_of(graph, saved, end.prev if end is anchor else end)
    if changed is not None:
        raise Decline(Reason.MUTATION, f"{changed.name} changes in place a tensor the fused op saves for "
                      "its backward")
    state, entry = states(graph)
    at = state[anchor]
    for n in absorbed:
        if state[n].blocks != at.blocks:
            raise Decline(Reason.STATE, f"{n.name} runs under {_describe(state[n])}, the fused op at "
                          f"{anchor.name} under {_describe(at)}")
    if all(state[n].grad == at.grad for n in absorbed):
        return set()  # one grad mode throughout: each result requires grad as before

    def enabled(n: Node) -> bool:
        return state[n].grad if isinstance(state[n].grad, bool) else bool(entry)

    gives_grad = enabled(anchor) and any(requires_grad(i) for i in inputs if isinstance(i, Node))
    detach = set()
    for r in results:
        if not requires_grad(r):
            if gives_grad:
                detach.add(r)  # the original computed it (or a step to it) under no_grad
            continue
        # the op's backward differentiates every step to r: each must have run with grad
        cone = () if replays_grad_modes else _cone(r, set(absorbed))
        off = next((a for a in cone if not enabled(a)), None)
        if not gives_grad or off is not None:
            raise Decline(Reason.STATE, f"{r.name} needs a gradient, and "
                          f"{(off or anchor).name} runs with grad disabled")
    return detach


def _cone(node: Node, within: set[Node]) -> set[Node]:
    """``node``'s ancestors in ``within`` (itself included when it is there)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        for a in ([n] if n in within else []) + [i for i in n.all_input_nodes if i in within]:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen
