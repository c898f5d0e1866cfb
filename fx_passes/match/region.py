"""What the matcher finds and the rewrite consumes: a region, its sinks, its nodes' roles.

Also how a sink is read off its node (:func:`make_sink`) and the one token / label
tensor a region's sinks share (:func:`region_index`); both decline what the rewrite
cannot compute.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..fx.graph_ops import canon, get_arg, last_dim, meta, tensor_input
from ..reporting.report import Decline, Reason

__all__ = ["Role", "Sink", "Region", "SINK_ROLES", "TERMINAL_ROLES", "ENTROPY_ROLES", "make_sink",
           "region_index", "row_indexed", "where"]


class Role(str, enum.Enum):
    """What a node is in a region (``Region.roles``), or what a sink computes (``Sink.role``)."""

    UPCAST = "upcast"  # x.float()
    VIEW = "view"  # an FP32 row view: [:, :-1], view(-1, V), ...
    SCALE = "scale"  # the temperature: z / t or z * s
    LOG_SOFTMAX = "L"  # log_softmax(z, -1)
    SOFTMAX = "P"  # softmax(z, -1), or exp(log_softmax(z))
    P_LOGP = "p_logp"  # P * L
    P_Z = "p_z"  # P * z
    # sinks: the per-row results, which anything may read
    LOGPROB = "logprob"  # L.gather(-1, tok[..., None]) / take_along_dim / L[arange(N), tok]
    LOSS = "loss"  # cross_entropy(z, labels) / nll_loss(L, labels)
    NEG_ENTROPY = "neg_entropy"  # (P * L).sum(-1)
    ENTROPY = "entropy"  # logsumexp(z) - (P * z).sum(-1)
    LSE = "lse"  # logsumexp(z, -1)
    EXPECTED_Z = "expected_z"  # (P * z).sum(-1)


SINK_ROLES = frozenset({Role.LOGPROB, Role.LOSS, Role.NEG_ENTROPY, Role.ENTROPY, Role.LSE,
                        Role.EXPECTED_Z})
TERMINAL_ROLES = frozenset({Role.LOGPROB, Role.LOSS, Role.NEG_ENTROPY, Role.ENTROPY})
ENTROPY_ROLES = frozenset({Role.NEG_ENTROPY, Role.ENTROPY, Role.EXPECTED_Z})


@dataclasses.dataclass
class Sink:
    node: Node
    role: Role
    keepdim: bool = False
    ignore_index: Any = -100  # an int, or a SymInt input's placeholder
    reduction: str = "none"
    indexed: bool = False  # a log-prob read as L[arange(N), tok] (no trailing dim of 1)


@dataclasses.dataclass
class Region:
    upcast: Node
    x: Node  # model-precision logits the rewritten region reads
    moved_scale: Optional[Node]  # bf16 temperature node moved after the upcast
    views: list[Node]  # FP32 row views, replayed on x
    scale: Any  # None, a Python number or a Node (SymFloat / 0-d tensor)
    scale_is_div: bool
    z: Node  # the scaled FP32 logits every head reads
    roles: dict[Node, Role]
    sinks: list[Sink]
    index: Optional[Node]  # gather index [.., 1] or CE labels [N]
    meta_users: list[tuple[Node, Node]]  # (shape query, FP32 node it reads)
    unit_scale_dropped: bool = False  # the region's temperature was a constant 1
    implicit: bool = False  # no upcast node: autocast (or the upgrade option) computes in FP32
    upgraded: bool = False  # model-precision heads computed in FP32 (upgrade_low_precision)

    @property
    def want_entropy(self) -> bool:
        return any(s.role in ENTROPY_ROLES for s in self.sinks)

    def describe(self) -> str:
        kinds = sorted({s.role.value for s in self.sinks})
        scale = "none" if self.scale is None else ("/" if self.scale_is_div else "*") + (
            self.scale.name if isinstance(self.scale, Node) else repr(self.scale))
        moved = ", temperature moved after the upcast" if self.moved_scale is not None else ""
        how = (", upgraded to FP32" if self.upgraded
               else ", implicit (autocast) upcast" if self.implicit else "")
        return f"{'+'.join(kinds)} over {tuple(meta(self.z).shape)} (temperature {scale}{moved}{how})"


# --- sinks and the index ----------------------------------------------------------

def make_sink(node: Node, role: Role, roles: dict[Node, Role], z: Node) -> Optional[Sink]:
    """The per-row result ``node`` as a Sink (None: it only feeds the entropy sub)."""
    if role in (Role.LSE, Role.EXPECTED_Z) and all(roles.get(u) == Role.ENTROPY for u in node.users):
        return None
    if role in (Role.LSE, Role.NEG_ENTROPY, Role.EXPECTED_Z, Role.ENTROPY):
        head = tensor_input(node) if role == Role.ENTROPY else node
        return Sink(node, role, keepdim=bool(get_arg(head, "keepdim", False)))
    if role == Role.LOGPROB and canon(node) == "getitem":
        return Sink(node, role, indexed=True)
    if role == Role.LOGPROB:
        dim = get_arg(node, "dim")
        if not last_dim(dim, meta(node).dim()):
            raise Decline(Reason.NOT_LAST_DIM, f"{node.name} gathers along dim={dim}")
        if get_arg(node, "sparse_grad", False):
            raise Decline(Reason.UNKNOWN_OP, f"{node.name} uses sparse_grad")
        return Sink(node, role)
    return _loss_sink(node, z)


def _loss_sink(node: Node, z: Node) -> Sink:
    """A cross_entropy / nll_loss the rewrite handles: no weights, no smoothing, [N, V]."""
    if meta(z).dim() != 2:
        raise Decline(Reason.LOSS_OPTIONS, f"{node.name}: logits of rank {meta(z).dim()}, "
                      "the pass handles [N, V] with the class dim last")
    bad = [k for k in ("weight", "size_average", "reduce") if get_arg(node, k) is not None]
    if get_arg(node, "label_smoothing", 0.0) not in (0, 0.0):
        bad.append("label_smoothing")
    reduction = get_arg(node, "reduction", "mean")
    ignore = get_arg(node, "ignore_index", -100)
    if isinstance(ignore, Node) and not _is_int_input(ignore):
        bad.append(f"ignore_index computed in the graph ({ignore.name})")
    elif not isinstance(ignore, (int, Node)) or isinstance(ignore, bool):
        bad.append(f"ignore_index={ignore!r}")
    if bad or reduction not in ("none", "sum", "mean"):
        raise Decline(Reason.LOSS_OPTIONS, f"{node.name}: {', '.join(bad) or reduction}")
    return Sink(node, Role.LOSS, ignore_index=ignore, reduction=reduction)


def region_index(sinks: list[Sink], z: Node) -> Optional[Node]:
    """The one token / label tensor the region's sinks read, or None."""
    found = set()
    for s in sinks:
        if s.role == Role.LOGPROB:
            idx = get_arg(s.node, "index" if canon(s.node) in ("gather", "getitem") else "indices")
            idx, one = (idx[1], ()) if s.indexed else (idx, (1,))
            vi, vz = meta(idx), meta(z)
            if (not isinstance(vi, torch.Tensor) or vi.dtype != torch.int64
                    or tuple(vi.shape) != tuple(vz.shape[:-1]) + one):
                raise Decline(Reason.INDEX_SHAPE, f"{s.node.name} index shape "
                              f"{tuple(getattr(vi, 'shape', ()))} for logits {tuple(vz.shape)}")
            found.add(("gather", idx))
        elif s.role == Role.LOSS:
            target = get_arg(s.node, "target")
            vt = meta(target)
            if (not isinstance(vt, torch.Tensor) or vt.dtype != torch.int64
                    or tuple(vt.shape) != tuple(meta(z).shape[:-1])):
                raise Decline(Reason.LOSS_OPTIONS, f"{s.node.name} target is not one class index per row")
            found.add(("labels", target))
    if len(found) > 1:
        raise Decline(Reason.SEVERAL_INDICES, ", ".join(n.name for _, n in found))
    return next(iter(found))[1] if found else None


def _is_int_input(node: Node) -> bool:
    """An int the compiled function receives (a SymInt input under dynamic=True)."""
    return node.op == "placeholder" and isinstance(meta(node), torch.SymInt)


def row_indexed(node: Node, src: Node) -> bool:
    """Is ``node`` ``src[arange(N), tok]``: one entry per row of the ``[N, V]`` tensor
    ``src`` picked by advanced indexing (a gather spelled as an index)?"""
    index = get_arg(node, "index") if canon(node) == "getitem" and tensor_input(node) is src else None
    vs = meta(src)
    if not (isinstance(index, tuple) and len(index) == 2 and isinstance(vs, torch.Tensor) and vs.dim() == 2):
        return False
    rows, cols = index
    vr, vc = meta(rows) if isinstance(rows, Node) else None, meta(cols) if isinstance(cols, Node) else None
    return (_is_arange(rows) and _per_row(vr, vs.shape[0]) and _per_row(vc, vs.shape[0])
            and vc.dtype == torch.int64)


def _per_row(v: Any, n: Any) -> bool:
    """A tensor of shape ``[n]`` for every value of its symbols."""
    return isinstance(v, torch.Tensor) and v.dim() == 1 and statically_known_true(v.shape[0] == n)


def _is_arange(node: Node) -> bool:
    """``torch.arange(n)`` / ``torch.arange(0, n)`` / ``torch.arange(0, n, 1)`` (its length checked apart)."""
    if node.op != "call_function" or node.target is not torch.arange:
        return False
    names = ("start", "end", "step") if len(node.args) > 1 else ("end",)
    args = {**dict(zip(names, node.args)), **node.kwargs}
    dtype = args.get("dtype", torch.int64)
    return args.get("start", 0) == 0 and args.get("step", 1) == 1 and dtype == torch.int64


def where(node: Node) -> str:
    """``node``'s name and the user's source line it comes from, for the log."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File")]
    return f"{node.name} ({lines[-1]})" if lines else node.name
