"""Find FP32-upcast regions in a Dynamo graph.

A region starts at a model-precision (bf16/fp16) logits tensor ``x`` and its FP32
upcast, goes through row views (``[:, :-1]``, ``view(-1, V)``) and at most one
scalar temperature, and ends in per-row reductions over the vocabulary:

    lp   = log_softmax(z, -1).gather(-1, tok[..., None])        # token log-prob
    ent  = -(softmax(z, -1) * log_softmax(z, -1)).sum(-1)       # entropy
    ent  = logsumexp(z, -1) - (softmax(z, -1) * z).sum(-1)      # entropy, other form
    loss = cross_entropy(z, labels, ignore_index=.., reduction=..)

Every FP32 ``[.., V]`` tensor of the region must be read only inside the region;
the per-row results ("sinks") may be read by anything.  A region that breaks a
rule raises :class:`~fx_passes.reporting.report.Decline` with the reason.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.fx import Graph, Node

from .. import compat
from ..config import Config
from ..fx.graph_ops import (
    canon,
    get_arg,
    is_fp32,
    is_low_precision,
    is_metadata_query,
    is_number,
    last_dim,
    meta,
    tensor_input,
)
from ..reporting.report import Decline, Reason
from .near_miss import index_spelling, model_precision_head
from .region import SINK_ROLES, TERMINAL_ROLES, Region, Role, Sink, make_sink, region_index, row_indexed
from .upcast import (
    HEADS,
    implicit_root,
    is_row_view,
    not_logits,
    scalar_operand,
    scaled_operand,
    upcast_behind,
    upcast_input,
    walk_back,
)

__all__ = ["Region", "Role", "Sink", "find_regions"]

# The structural kind of the scaled FP32 logits themselves, next to Role.LOG_SOFTMAX and
# Role.SOFTMAX (z is the end of the upcast chain, whatever role that node has).
_Z = "z"


class _Matcher:
    """Grows one region from its root.

    ``root`` is an explicit upcast node (``x.float()``), or, in implicit mode, the
    model-precision logits themselves, read by heads that compute in FP32 without
    an upcast node in the graph: autocast's FP32 ops (``cross_entropy`` everywhere,
    ``log_softmax`` / ``softmax`` on CUDA), or, with ``upgrade_low_precision``,
    model-precision heads the user asked to compute in FP32.
    """

    def __init__(self, root: Node, temperature_after_upcast: bool, implicit: bool = False,
                 upgrade: bool = False) -> None:
        self.upcast = root
        self.move_scale = temperature_after_upcast
        self.implicit = implicit
        self.upgrade = upgrade
        self.roles: dict[Node, Role] = {} if implicit else {root: Role.UPCAST}
        self.meta_users: list[tuple[Node, Node]] = []

    def match(self) -> Region:
        views, scale, is_div, z = self._walk_chain()
        self.z = z
        vz = meta(z)
        if vz.dim() < 1 or (isinstance(vz.shape[-1], int) and vz.shape[-1] < 2):
            raise Decline(Reason.VOCAB_TOO_SMALL, f"shape {tuple(vz.shape)}")
        self._classify_users(z)
        x, moved, scale, is_div = self._temperature(scale, is_div)
        unit_scale = is_number(scale) and scale == 1
        if unit_scale:
            scale = None  # x / 1.0: nothing to divide
        sinks = [make_sink(n, r, self.roles, z) for n, r in self.roles.items() if r in SINK_ROLES]
        sinks = [s for s in sinks if s is not None]
        if not sinks:
            raise Decline(Reason.ESCAPES, "no per-row result: the FP32 tensor itself is what the graph uses")
        self._check_no_escape()
        return Region(upcast=self.upcast, x=x, moved_scale=moved, views=views, scale=scale,
                      scale_is_div=is_div, z=z, roles=self.roles, sinks=sinks,
                      index=region_index(sinks, z), meta_users=self.meta_users,
                      unit_scale_dropped=unit_scale, implicit=self.implicit,
                      upgraded=any(is_low_precision(n) for n in self.roles))

    def _walk_chain(self) -> tuple[list[Node], Any, bool, Node]:
        """FP32 row views and at most one scaling after the upcast: (views, scale, is_div, z)."""
        views, scale, is_div, cur = [], None, True, self.upcast
        while not self.implicit:
            users = self._users(cur)
            if len(users) != 1:
                break
            (u,) = users
            if is_row_view(u, cur):
                views.append(u)
                self.roles[u] = Role.VIEW
            elif (s := scalar_operand(u, cur)) is not None:
                if scale is not None:
                    raise Decline(Reason.TEMPERATURE, "several scalings of the FP32 logits")
                (scale, is_div), self.roles[u] = s, Role.SCALE
            else:
                break
            cur = u
        return views, scale, is_div, cur

    def _temperature(self, scale: Any, is_div: bool) -> tuple[Node, Optional[Node], Any, bool]:
        """(x, the moved node or None, scale, is_div): a model-precision ``x / t`` that only
        the region reads, right before the upcast, is divided after it instead."""
        x = self.z if self.implicit else tensor_input(self.upcast)
        only_region = all(u in self.roles or is_metadata_query(u) for u in x.users)
        if self.move_scale and scale is None and only_region and (m := self._moved_scale(x)):
            return m[0], x, m[1], m[2]
        return x, None, scale, is_div

    def _moved_scale(self, node: Node) -> Optional[tuple[Node, Any, bool]]:
        """A model-precision ``x / t`` feeding only the region: (x, t, is_div) to divide after."""
        src = scaled_operand(node)
        try:
            s = scalar_operand(node, src)
        except Decline:
            return None  # e.g. a per-row temperature: it stays where it is
        if s is None or not isinstance(src, Node) or not is_low_precision(src):
            return None
        return src, s[0], s[1]

    def _check_no_escape(self) -> None:
        """Every FP32 [.., V] node of the region is read only inside it (or by shape queries)."""
        for n, r in self.roles.items():
            if r in SINK_ROLES:
                continue
            for u in n.users:
                if u not in self.roles and not is_metadata_query(u):
                    where = "the graph output" if u.op == "output" else f"{u.name} ({u.target})"
                    raise Decline(Reason.ESCAPES, f"{n.name} is read by {where}")

    def _users(self, node: Node) -> list[Node]:
        out = []
        for u in node.users:
            if is_metadata_query(u):
                self.meta_users.append((u, node))
            else:
                out.append(u)
        return out

    def _kind(self, node: Any) -> Optional[str]:
        """Structural kind of an operand: z, L = log_softmax(z), P = softmax(z) / exp(L)."""
        if node is self.z:
            return _Z
        if not isinstance(node, Node):
            return None
        op, src = canon(node), tensor_input(node)
        if op == "log_softmax" and src is self.z:
            return Role.LOG_SOFTMAX
        if op == "softmax" and src is self.z:
            return Role.SOFTMAX
        if op == "exp" and self._kind(src) == Role.LOG_SOFTMAX:
            return Role.SOFTMAX
        return None

    def _classify_users(self, start: Node) -> None:
        queue = [start]
        while queue:
            node = queue.pop()
            for u in self._users(node):
                if u in self.roles:
                    continue
                role = self._role(u, node)
                if role is not None and node is self.z and self.implicit and not self._fp32_head(u):
                    role = None
                if role is None:
                    self._check_unknown_reader(u, node)
                    continue
                self.roles[u] = role
                if role not in TERMINAL_ROLES:
                    queue.append(u)

    def _check_unknown_reader(self, u: Node, node: Node) -> None:
        """``u`` reads ``node`` and has no role: fine where a non-FP32 or per-row value is
        read, else a decline (the FP32 tensor escapes, or an op the pass does not know)."""
        if node is self.z and self.implicit:
            return  # the model-precision logits may be read by anything
        if u.op == "output" or self.roles.get(node) in (Role.LSE, Role.EXPECTED_Z):
            return  # a per-row result read outside, or an escape checked later
        if any(o.op == "output" for o in node.users) and self.roles.get(node) not in SINK_ROLES:
            # the FP32 tensor itself is a graph output: that decides, whatever else reads it
            raise Decline(Reason.ESCAPES, f"{node.name} is read by the graph output")
        d = Decline(Reason.UNKNOWN_OP, f"{u.name} ({u.target}) reads {node.name}")
        d.reader = u  # (near_miss.index_spelling reads it)
        raise d

    def _fp32_head(self, head: Node) -> bool:
        """In implicit mode: does this head of the low-precision logits compute in FP32?"""
        return is_fp32(head) or (self.upgrade and is_low_precision(head))

    def _role(self, u: Node, src: Node) -> Optional[Role]:
        """The role of ``u``, which reads ``src`` (z or a node of the region), or None."""
        op = canon(u)
        if op in HEADS:
            return self._head_role(u, src, op)
        kind = self._kind(src) or self.roles.get(src)
        if op == "exp" and kind == Role.LOG_SOFTMAX:
            return Role.SOFTMAX
        if op == "mul":
            kinds = {self._kind(tensor_input(u)), self._kind(get_arg(u, "other"))}
            if kinds == {Role.SOFTMAX, Role.LOG_SOFTMAX}:
                return Role.P_LOGP
            return Role.P_Z if kinds == {Role.SOFTMAX, _Z} else None
        if op == "sum" and self.roles.get(src) in (Role.P_LOGP, Role.P_Z):
            if not last_dim(get_arg(u, "dim"), meta(src).dim()) or get_arg(u, "dtype") is not None:
                raise Decline(Reason.NOT_LAST_DIM, f"{u.name} sums dim={get_arg(u, 'dim')}")
            return Role.NEG_ENTROPY if self.roles[src] == Role.P_LOGP else Role.EXPECTED_Z
        if op == "sub" and self._is_entropy_sub(u):
            return Role.ENTROPY
        if op in ("gather", "take_along_dim", "nll_loss") and kind == Role.LOG_SOFTMAX \
                and tensor_input(u) is src:
            return Role.LOSS if op == "nll_loss" else Role.LOGPROB
        if op == "getitem" and kind == Role.LOG_SOFTMAX and row_indexed(u, src):
            return Role.LOGPROB  # L[arange(N), tok]: a gather
        return None

    def _head_role(self, u: Node, src: Node, op: str) -> Optional[Role]:
        """``log_softmax`` / ``softmax`` / ``logsumexp`` / ``cross_entropy`` of z."""
        if src is not self.z:
            return None
        if op == "logsumexp":
            if not last_dim(get_arg(u, "dim"), meta(src).dim()):
                raise Decline(Reason.NOT_LAST_DIM, f"{u.name} dim={get_arg(u, 'dim')}")
            return Role.LSE
        if tensor_input(u) is not src:
            return None
        if op == "cross_entropy":
            return Role.LOSS
        _check_softmax_like(u)
        return Role.LOG_SOFTMAX if op == "log_softmax" else Role.SOFTMAX

    def _is_entropy_sub(self, u: Node) -> bool:
        a, b = tensor_input(u), get_arg(u, "other")
        return (isinstance(a, Node) and isinstance(b, Node) and canon(a) == "logsumexp"
                and tensor_input(a) is self.z and canon(b) == "sum"
                and self.roles.get(b) == Role.EXPECTED_Z and get_arg(u, "alpha") in (None, 1)
                and bool(get_arg(a, "keepdim", False)) == bool(get_arg(b, "keepdim", False)))


def _check_softmax_like(node: Node) -> None:
    if not last_dim(get_arg(node, "dim"), meta(node).dim()):
        raise Decline(Reason.NOT_LAST_DIM, f"{node.name} dim={get_arg(node, 'dim')}")
    if get_arg(node, "dtype") not in (None, torch.float32):
        raise Decline(Reason.UNKNOWN_OP, f"{node.name} casts to {get_arg(node, 'dtype')}")


def find_regions(graph: Graph, config: Config = Config()) -> list[Region | tuple[Node, Decline]]:
    """Every candidate region, in graph order: a Region, or (root node, Decline)."""
    temperature_after_upcast, upgrade_low_precision = config.temperature_after_upcast, \
        config.upgrade_low_precision
    out: list[Region | tuple[Node, Decline]] = []
    seen: set[Node] = set()
    hinted: set[Any] = set()  # model-precision logits a near miss was said for
    for node in list(graph.nodes):
        if canon(node) not in HEADS:
            continue
        implicit = implicit_root(node, upgrade_low_precision)
        if implicit is not None:
            root, matcher = implicit, _Matcher(implicit, temperature_after_upcast, implicit=True,
                                               upgrade=upgrade_low_precision)
        else:
            if not is_fp32(tensor_input(node)):
                if tensor_input(node) not in hinted:  # (one hint per logits)
                    hinted.add(tensor_input(node))
                    model_precision_head(node, upgrade_low_precision)
                continue
            root = walk_back(node)
            matcher = _Matcher(root, temperature_after_upcast)
        if not isinstance(root, Node) or root in seen:
            continue
        seen.add(root)
        if compat.is_dtensor(meta(root)):
            placements = getattr(meta(root), "placements", ())
            out.append((root, Decline(Reason.DTENSOR, f"{root.name} has placements {tuple(placements)}")))
            continue
        if implicit is None and upcast_input(root) is None:
            if is_fp32(root):
                up = upcast_behind(root)
                d = (Decline(Reason.UNKNOWN_OP, f"{root.name} ({root.target}) is between the upcast "
                             f"{up.name} and {node.name}") if up is not None else
                     Decline(Reason.NOT_LOW_PRECISION, f"{root.name} is FP32 already"))
                if not not_logits(root, d):
                    out.append((root, d))
            continue
        try:
            out.append(matcher.match())
        except Decline as d:
            index_spelling(d)
            if not not_logits(root, d):
                out.append((root, d))
    return out
