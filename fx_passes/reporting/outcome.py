"""What a rewrite did with a region besides rewriting it: the typed result that the
single-process and vocab-parallel rewrites (and the loss-tail rewrites) return, and
:func:`counted`, the one place that turns it into counters and words for the log."""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from torch._dynamo.utils import counters

from .report import COUNTER

__all__ = ["LMHead", "LossInCall", "Outcome", "counted"]


class LMHead(str, enum.Enum):
    """What became of the matmul that makes the region's logits."""

    NONE = "none"  # no lm_head matmul near the region, and nothing to say
    FUSED = "fused"  # computed inside the chunk loop: the logits never exist whole
    NOT_FUSED = "not_fused"  # run once in full before the region (``why`` says why)
    IN_CALL = "in_call"  # run whole by a row-local call, whose backward writes the logits' gradient over them


@dataclasses.dataclass(frozen=True)
class LossInCall:
    """A loss tail that the region's call computes, its gradients in the forward
    (:mod:`fx_passes.rewrite.loss_tail`)."""

    tail: str  # what the tail is (``LossTail.describe``)
    plan: str  # "gpu" or "two_sweeps"
    gemms: int  # model-precision GEMMs a step with a unit incoming gradient
    masked_rows: bool = False  # the call skips the rows the loss leaves out
    rows_why: str = ""  # the loss has a mask, but every row runs: why (NOTE [why every row runs])

    def describe(self) -> str:
        rows = ", rows the loss leaves out skipped" if self.masked_rows else \
            f", every row runs though the loss has a mask: {self.rows_why}" if self.rows_why else ""
        return (f", gradients in the forward through its {self.tail} ({self.plan}: {self.gemms} GEMMs a step "
                "with a unit incoming gradient)" + rows)


@dataclasses.dataclass(frozen=True)
class Outcome:
    lm_head: LMHead = LMHead.NONE
    why: str = ""  # why the lm_head stays whole (NOT_FUSED), or why a call keeps its logits (IN_CALL)
    returns_logits: bool = False  # the fused loop also writes the logits the graph returns
    one_pass: Optional[bool] = None  # vocab-parallel, lm_head fused: all stages in one pass?
    one_pass_why: str = ""  # why not (one_pass False)
    saved_masks: int = 0  # row-local: boolean masks its forward saves (packed) for its backward
    saved_normalizers: int = 0  # row-local: softmax normalisers its forward saves for its backward
    losses: tuple[LossInCall, ...] = ()  # the loss tails its calls compute (gradients in the forward)
    masked_per_token: int = 0  # fused calls keeping per-token results that skip the rows nothing reads
    rows_why: tuple[str, ...] = ()  # those with a mask that run every row: why (NOTE [why every row runs])
    kept_logits: int = 0  # fused calls keeping their model-precision logits for the backward (lm_head_plan)

    @classmethod
    def not_fused(cls, why: str, **kw) -> "Outcome":
        """The lm_head stays whole for ``why`` ("" when there is no lm_head to speak of)."""
        return cls(LMHead.NOT_FUSED if why else LMHead.NONE, why, **kw)


def counted(outcome: Outcome, what: str, fused: str) -> str:
    """Count what a rewrite's ``outcome`` says (``fused``: the counter of a fused lm_head)
    and add it to the rewrite's description ``what``: the one reader of outcomes."""
    c = counters[COUNTER]
    if outcome.lm_head is LMHead.FUSED:
        c[fused] += 1
        what += ", lm_head matmul fused into the chunk loop"
        if outcome.returns_logits:
            c["lm_head_returns_logits"] += 1
            what += ", which also writes the logits the graph returns"
    elif outcome.lm_head is LMHead.IN_CALL:
        c["row_local_lm_head_in_call"] += 1
        what += ", lm_head matmul run by the call, whose backward writes the logits' gradient over them"
        if outcome.why:
            what += f" (logits kept whole: {outcome.why})"
    elif outcome.lm_head is LMHead.NOT_FUSED:
        c["lm_head_not_fused"] += 1
        what += f", lm_head not fused: {outcome.why}"
    if outcome.one_pass:
        c["vocab_parallel_one_pass"] += 1
        what += ", its stages in one pass over the rows"
    elif outcome.one_pass is False:
        what += f", one lm_head pass per stage: {outcome.one_pass_why}"
    for loss in outcome.losses:
        c["gradients_in_forward"] += 1
        if loss.masked_rows:
            c["masked_rows"] += 1
        elif loss.rows_why:
            c["masked_rows_not_skipped"] += 1
        what += loss.describe()
    if outcome.kept_logits:
        c["kept_logits"] += outcome.kept_logits
        what += ", its logits kept for the backward (the kept_logits plan: no recompute, three GEMMs)"
    if outcome.masked_per_token:
        c["masked_rows"] += outcome.masked_per_token
        what += ", rows whose per-token results nothing reads (a mask) skipped"
    for why in outcome.rows_why:
        c["masked_rows_not_skipped"] += 1
        what += f", every row's per-token results computed though a mask leaves some unread: {why}"
    if outcome.saved_masks:
        c["row_local_saved_masks"] += 1
        what += f", {outcome.saved_masks} mask(s) saved bit-packed for the backward (no sort again)"
    if outcome.saved_normalizers:
        c["row_local_saved_normalizers"] += 1
        what += f", {outcome.saved_normalizers} softmax normaliser(s) saved for the backward"
    return what
