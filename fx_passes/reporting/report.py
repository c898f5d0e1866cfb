"""What the passes rewrote, what they declined and why: counters, logs, a summary.

Counters live in ``torch._dynamo.utils.counters["chunked_logits"]``:
``rewritten``, ``declined``, ``left_to_stock``, ``near_miss``, ``div_by_one_removed``, ``pass_failed``, one
``declined:<reason>`` per reason, and the lm_head / vocab-parallel ones
(docs/how-it-works.md, section 7); each event also goes to ``session.session`` (for
the exit summary).  Logs go to the ``fx_passes`` logger: ``TORCH_LOGS="fx_passes"`` shows each rewrite and
decline, ``TORCH_LOGS="+fx_passes"`` adds the graphs before and after.
"""

from __future__ import annotations

import enum
import functools
import logging

import torch._guards
from torch._dynamo.utils import counters

from .session import Event, session

__all__ = ["Decline", "Reason", "Event", "log", "COUNTER", "record_rewrite", "record_decline",
           "record_left_to_stock", "record_near_miss", "say_once", "note_graph"]

COUNTER = "chunked_logits"
log = logging.getLogger("fx_passes")


class Reason(str, enum.Enum):
    """Every reason the pass leaves a region as it was (docs/declines.md lists them)."""

    NOT_LOW_PRECISION = ("the logits are not bf16/fp16 before the FP32 upcast (already FP32 or integer): "
                         "nothing to save")
    ESCAPES = ("an FP32 [.., V] tensor of the region is used outside the pattern "
               "(a graph output or another consumer)")
    UNKNOWN_OP = "an op the pass does not know reads the FP32 logits"
    NOT_ROW_LOCAL = ("an op of the region mixes rows (a reduction or a view across rows), or is not known "
                     "to act on each row on its own")
    NOT_LAST_DIM = "the softmax / reduction is not over the last (vocabulary) dim"
    VOCAB_TOO_SMALL = "the vocabulary dim has size 1"
    TEMPERATURE = ("the temperature is not one scalar (per-row tensor, tensor that requires grad, "
                   "or several scalings)")
    INDEX_SHAPE = "the gather index is not exactly one token per row of the logits"
    LOSS_OPTIONS = ("cross_entropy / nll_loss with class weights, label smoothing, a class dim other "
                    "than the last, an ignore_index computed in the graph, or legacy size_average/reduce")
    SEVERAL_INDICES = "several different token / label tensors read one upcast"
    ORDER = "the token indices depend on a value the region produces, or on a side effect"
    MUTATION = ("an in-place op runs between the region's first node (the lm_head matmul included) and "
                "its last: the fused op could read an operand at another version than the original did")
    STATE = ("the region's nodes run under different autocast / inference_mode blocks, or a result "
             "that needs a gradient has a step computed with grad disabled")
    DTENSOR = ("the logits are a DTensor (tensor parallel): the pass takes the loss written on the "
               "local shard with functional collectives instead (docs/distributed.md)")


class Decline(Exception):
    """Raised inside matching: leave this region as it is."""

    def __init__(self, reason: Reason, detail: str = "") -> None:
        super().__init__(f"{reason.value}{': ' + detail if detail else ''}")
        self.reason = reason
        self.detail = detail


@functools.lru_cache(None)
def say_once(level: int, message: str, *args: object) -> None:
    """``log.log(level, message, *args)`` the first time this process sees these values
    (a run-time fall-back said once, not each step)."""
    log.log(level, message, *args)


def record_rewrite(where: str, what: str, fp32_bytes: int, report_only: bool) -> None:
    kind = "would_rewrite" if report_only else "rewritten"
    counters[COUNTER][kind] += 1
    session.record(Event(kind, where, what, fp32_bytes))
    # report_only is asked for: said at WARNING, which Python prints without any logging set up
    log.log(logging.WARNING if report_only else logging.INFO,
            "chunked_logits: %s %s at %s (bytes avoided per call: %s)",
            "would rewrite" if report_only else "rewrote", what, where, fp32_bytes or "symbolic or none")


def record_decline(where: str, decline: Decline) -> None:
    counters[COUNTER]["declined"] += 1
    counters[COUNTER][f"declined:{decline.reason.name}"] += 1
    session.record(Event("declined", where, str(decline), reason=decline.reason))
    log.info("chunked_logits: declined region at %s: %s", where, decline)


def record_left_to_stock(where: str, what: str, why: str, report_only: bool) -> None:
    """A region the pass can rewrite but leaves to stock Inductor, which runs it as well
    (``why``: :mod:`fx_passes.match.worth`): not a failure, so not a decline."""
    counters[COUNTER]["left_to_stock"] += 1
    session.record(Event("left_to_stock", where, f"{what}: {why}"))
    log.log(logging.WARNING if report_only else logging.INFO,
            "chunked_logits: left %s at %s to stock Inductor: %s", what, where, why)


def record_near_miss(where: str, message: str) -> None:
    """A hint for the user: the graph at ``where`` almost had something to rewrite, and
    ``message`` says what to change.  Each distinct (where, message) is recorded once
    (a recompile says it again): one ``near_miss`` count, one event, one WARNING line."""
    if session.has("near_miss", where, message):
        return
    counters[COUNTER]["near_miss"] += 1
    session.record(Event("near_miss", where, message))
    log.warning("chunked_logits: near miss at %s: %s", where, message)


# NOTE [a restarted compile]
# Dynamo may restart a frame's analysis after the backend (or Inductor's pre-grad passes)
# ran on its graph: Inductor's pass that turns Python float arguments into tensors raises
# RestartAnalysis to specialize one (``torch.compile(..., dynamic=True)`` on ``z / t`` with
# a float ``t``), and the frame is traced and compiled again under the same compile id, one
# attempt later.  The abandoned attempt's rewrites never run; without this, the summary and
# the counters would claim each twice ("x2 compiles").  Each graph the passes look at notes
# its compile's context and attempt (``torch._guards.CompileContext``: one object per
# compile, its ``attempt`` counted up by each restart; compile ids start over after
# ``torch._dynamo.reset()``, so the object, not its id, says which compile); a later attempt
# of the compile the passes saw last takes back what the earlier one recorded.  The backend
# notes its graph before its containment's snapshot, so a failure of the new attempt rolls
# back to it.


def note_graph() -> None:
    """Count a graph the passes look at (the backend's or the installed pass's), after
    taking back what an attempt Dynamo abandoned recorded: NOTE [a restarted compile]."""
    context = torch._guards.CompileContext.try_get()
    if context is not None and context.compile_id is not None:
        back = session.start_attempt(context, context.attempt, dict(counters[COUNTER]))
        if back is not None:
            counters[COUNTER].clear()
            counters[COUNTER].update(back)
    session.count_graph()
