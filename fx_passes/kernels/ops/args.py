"""The ops' arguments at the Python edge, by name, and why that edge stays flat.

Every thin edge takes flat parameters: a custom op's implementation and fake (the schema
``torch.library`` infers from the signature takes tensors, numbers, bools, strings and lists
of them, never a dataclass) and each ``emitted`` function a rewritten graph calls (FX graph
code, Inductor's FX graph cache pickling and the ops' schemas accept only those values, so a
call's arguments are graph nodes and constants of those types).  The rule
(``tests/test_layout.py``): no function takes more than 8 parameters but such an edge,
decorated ``custom_op``, ``register_fake`` or ``emitted``, with at most 8 statements that
unpack into these types and call on; a rewrite reading an emitted call unpacks it too
(:meth:`HeadOptions.from_node`, :func:`head_of_node`).  ``Head``: the region's tensors;
``HeadOptions``: what it computes and how (never a tensor); ``LogitMap``: how a chunk's
matmul output becomes the scaled FP32 logits; ``RowValues`` / ``Cotangents``: the per-row
values a backward reads and the gradients flowing into them; ``LossOptions``: the loss
tail's (``lm_head_loss``); ``Region``: a row-local region's body and inputs;
``LogitsInput``: its row input that is the lm_head's logits (``row_local_sweeps``,
``row_local_loss``); ``RowLossOptions``: ``row_local_loss``'s loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple, Optional

import torch
from torch.fx import Node

from ...fx.graph_ops import bound_args

__all__ = ["Head", "HeadOptions", "LogitMap", "RowValues", "Cotangents", "LossOptions", "Region",
           "LogitsInput", "RowLossOptions", "head_of_node", "args_by_name", "grads_by_name"]


class Head(NamedTuple):
    """The lm_head region's tensors (``Node``s in a graph): ``hidden @ weight.T + bias``,
    the sampled ``tokens`` (None: no token log-prob) and the temperature ``scale``."""

    hidden: Any  # [N, H]
    weight: Any  # [V, H]
    bias: Any = None  # [V]
    tokens: Any = None  # [N] int64
    scale: Any = None  # 0-d FP32, or None

    @classmethod
    def flat(cls, hidden, weight, bias, tokens, scale) -> "Head":
        """As an emitted call gets them (``hidden`` ``[.., H]``, ``tokens`` ``[..]``, ``scale``
        a number or a tensor) for an op: rows flattened, ``scale`` a 0-d FP32 tensor."""
        if scale is not None and not isinstance(scale, torch.Tensor):
            scale = torch.scalar_tensor(scale, dtype=torch.float32, device=hidden.device)
        return cls(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                   tokens.reshape(-1) if tokens is not None else None, scale)

    def rows(self, r0: int, r1: int) -> "Head":
        """The rows ``[r0, r1)``."""
        tok = self.tokens[r0:r1] if self.tokens is not None else None
        return self._replace(hidden=self.hidden[r0:r1], tokens=tok)

    def take(self, index: torch.Tensor) -> "Head":
        """The rows ``index``."""
        tok = self.tokens[index] if self.tokens is not None else None
        return self._replace(hidden=self.hidden[index], tokens=tok)


@dataclasses.dataclass(frozen=True)
class HeadOptions:
    """What a region computes per row and how (the flat arguments after the tensors, in
    the order of the ops' schemas)."""

    scale_is_div: bool  # z = x / scale (True) or x * scale
    want_entropy: bool
    budget_bytes: int  # 0: the device's default (tiling.resolve_budget)
    transforms: str = ""  # the logit transforms before the scale (bodies.parse_transforms)
    plan: str = "auto"  # the backward's plan (tiling.backward_plan)

    def to_args(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> "HeadOptions":
        """From arguments by name (extra names ignored, missing ones their defaults)."""
        return cls(**{f.name: args[f.name] for f in dataclasses.fields(cls) if f.name in args})

    @classmethod
    def from_node(cls, node: Node) -> "HeadOptions":
        """The options of an emitted call (``lm_head_row_stats``, ``lm_head_loss``)."""
        return cls.from_args(bound_args(node))

    def logit_map(self, dtype: torch.dtype, scale: Optional[torch.Tensor]) -> "LogitMap":
        return LogitMap(dtype, self.transforms, scale, self.scale_is_div)


class LogitMap(NamedTuple):
    """How a chunk's matmul output becomes the FP32 logits ``z`` the reductions read:
    rounded to the model ``dtype``, the ``transforms`` (in FP32), then ``/ scale`` or
    ``* scale``."""

    dtype: torch.dtype
    transforms: str
    scale: Optional[torch.Tensor]
    is_div: bool


class RowValues(NamedTuple):
    """The per-row values a backward reads: the forward's lse and entropy (None when the
    forward computed none), and what the FP32 lse rounded away where the forward kept it
    (``given.lse_residual``; None: not kept)."""

    lse: Any
    entropy: Any = None
    lse_lo: Any = None

    def rows(self, r0: int, r1: int) -> "RowValues":
        return RowValues(*(v[r0:r1] if v is not None else None for v in self))


class Cotangents(NamedTuple):
    """The gradients flowing into each row's lse, token log-prob and entropy (None: none)."""

    lse: Any
    logprob: Any
    entropy: Any

    def rows(self, r0: int, r1: int) -> "Cotangents":
        return Cotangents(*(v[r0:r1] if v is not None else None for v in self))

    def times(self, g: Any) -> "Cotangents":
        return Cotangents(*(v * g if v is not None else None for v in self))


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """The loss tail of ``lm_head_loss`` (:mod:`fx_passes.rewrite.loss_tail`): its row
    part and scalar part (``GRAPH_BODIES`` keys), each reduction's kind and dtype, which
    gradients are wanted, and the tail's skip graph ("" for none)."""

    tail_key: str
    final_key: str
    kinds: str  # "sum:float32,mean:float32"
    need_hidden: bool
    need_weight: bool  # (the bias's gradient too)
    mask_key: str = ""

    def to_args(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> "LossOptions":
        return cls(**{f.name: args[f.name] for f in dataclasses.fields(cls) if f.name in args})


@dataclasses.dataclass(frozen=True)
class Region:
    """A row-local region: its body ``key`` (``GRAPH_BODIES``) on the ``rows`` (the
    inputs with one value per row, first dim) and the tensors it reads ``whole``, run in
    chunks that fit ``budget_bytes``."""

    key: str
    rows: list
    whole: list
    budget_bytes: int
    kept: Any = None  # (the rows the loop runs, ascending; None: all; their inputs gathered per chunk)

    def chunk(self, a: int, b: int) -> list:
        """The body's row inputs of rows ``[a, b)`` (of the kept rows, where some are)."""
        if self.kept is None:
            return [r[a:b] for r in self.rows]
        return [r[self.kept[a:b]] for r in self.rows]

    def gathered(self) -> "Region":
        """The same region with its kept rows' inputs gathered whole (every row of it runs)."""
        if self.kept is None:
            return self
        return dataclasses.replace(self, rows=[r[self.kept] for r in self.rows], kept=None)


class LogitsInput(NamedTuple):
    """The region's row input ``index`` that is the lm_head's logits ``h @ weight.T + bias``
    (``h`` ``[N, H]``; ``how``: ``"linear"`` or ``"matmul"``), made chunk by chunk."""

    index: int
    h: Any
    weight: Any
    bias: Any
    how: str


@dataclasses.dataclass(frozen=True)
class RowLossOptions:
    """``row_local_loss``'s loss: its scalar part ``final_key`` on the reductions
    (``kinds``) and the ``n_final`` last whole inputs; ``width``: bytes a row of the split's
    per-row values; ``plan``: ``"gpu"`` or ``"two_sweeps"``."""

    final_key: str
    kinds: str
    n_final: int
    width: int
    plan: str

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> "RowLossOptions":
        return cls(**{f.name: args[f.name] for f in dataclasses.fields(cls) if f.name in args})

    def final_whole(self, whole: list) -> list:
        """The whole inputs the scalar part reads."""
        return whole[len(whole) - self.n_final:]


def head_of_node(node: Node) -> Head:
    """The region's tensors (nodes) of an emitted lm_head call."""
    args = bound_args(node)
    return Head(*(args[name] for name in Head._fields))


def args_by_name(op: Any, inputs: tuple) -> dict[str, Any]:
    """The inputs of a call of the custom op ``op`` (an autograd ``setup_context``'s), by name."""
    return {arg.name: value for arg, value in zip(op._opoverload._schema.arguments, inputs)}


def grads_by_name(op: Any, lengths: Mapping[str, int], **grads: Any) -> tuple:
    """The gradient of each input of the custom op ``op`` in its schema's order: those in
    ``grads`` by name, None for the others (a list of tensors: ``lengths[name]`` Nones)."""
    out: list[Any] = []
    for arg in op._opoverload._schema.arguments:
        if arg.name in grads:
            out.append(grads[arg.name])
        else:
            out.append([None] * lengths[arg.name] if arg.name in lengths else None)
    return tuple(out)
