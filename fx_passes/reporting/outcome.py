"""What a rewrite did with a region besides rewriting it: the typed result that the
single-process and vocab-parallel rewrites return and :mod:`fx_passes.pipeline` counts
and logs in one place."""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

__all__ = ["LMHead", "Outcome"]


class LMHead(str, enum.Enum):
    """What became of the matmul that makes the region's logits."""

    NONE = "none"  # no lm_head matmul near the region, and nothing to say
    FUSED = "fused"  # computed inside the chunk loop: the logits never exist whole
    NOT_FUSED = "not_fused"  # run once in full before the region (``why`` says why)
    IN_CALL = "in_call"  # run whole by a row-local call, whose backward writes the logits' gradient over them


@dataclasses.dataclass(frozen=True)
class Outcome:
    lm_head: LMHead = LMHead.NONE
    why: str = ""  # why the lm_head stays whole (NOT_FUSED), or why a call keeps its logits (IN_CALL)
    returns_logits: bool = False  # the fused loop also writes the logits the graph returns
    one_pass: Optional[bool] = None  # vocab-parallel, lm_head fused: all stages in one pass?
    one_pass_why: str = ""  # why not (one_pass False)
    saved_masks: int = 0  # row-local: boolean masks its forward saves (packed) for its backward
    saved_normalizers: int = 0  # row-local: softmax normalisers its forward saves for its backward
    gradients_in_forward: str = ""  # row-local, lm_head chunked: its loss tail, computed by its call

    @classmethod
    def not_fused(cls, why: str, **kw) -> "Outcome":
        """The lm_head stays whole for ``why`` ("" when there is no lm_head to speak of)."""
        return cls(LMHead.NOT_FUSED if why else LMHead.NONE, why, **kw)
