"""``fx_passes.SummaryCallback``: :func:`fx_passes.summary` in a Hugging Face Trainer's logs.

    trainer = Trainer(..., callbacks=[fx_passes.SummaryCallback()])

At the first log after the passes looked at a graph, the callback adds flat numeric keys
``chunked_logits/<name>`` (the summary's counts, one ``declined/<REASON>`` per reason) to
that log entry, once.  Callbacks before it (the ``report_to`` integrations) do not see them:
put it first to log them there.  transformers is imported here only; without it, making a
``SummaryCallback`` raises ImportError.  See NOTE [summary keys].
"""

# NOTE [summary keys]
# At the first log after the passes looked at a graph (the first step compiles), the
# callback adds flat numeric keys to that log, once: ``chunked_logits/regions_rewritten``,
# ``chunked_logits/regions_would_rewrite``, ``chunked_logits/regions_left_to_stock``,
# ``chunked_logits/regions_declined``,
# ``chunked_logits/near_misses``, ``chunked_logits/estimated_bytes_avoided``,
# ``chunked_logits/graphs_compiled``, ``chunked_logits/pass_failed`` and one
# ``chunked_logits/declined/<REASON>`` per decline reason.  They go into that entry of
# ``trainer.state.log_history`` and to every callback after this one.  The Trainer calls
# callbacks in order, the ``report_to`` integrations (wandb, TensorBoard) first: for them to
# see the keys, put this callback first (``trainer.callback_handler.callbacks.insert(0,
# fx_passes.SummaryCallback())``).

from __future__ import annotations

from typing import Any, Optional

from ..reporting.public import summary

__all__ = ["SummaryCallback", "flat_summary"]

PREFIX = "chunked_logits/"
_NUMBERS = ("regions_rewritten", "regions_would_rewrite", "regions_left_to_stock", "regions_declined",
            "estimated_bytes_avoided", "graphs_compiled", "pass_failed")

try:
    from transformers import TrainerCallback as _Base
except ImportError:  # the callback is the only thing here that needs transformers
    _Base = None


def flat_summary(data: Optional[dict[str, Any]] = None) -> dict[str, int]:
    """:func:`fx_passes.summary` as flat ``chunked_logits/...`` numbers (for a metrics logger)."""
    data = summary() if data is None else data
    flat = {PREFIX + key: int(data[key]) for key in _NUMBERS}
    flat[PREFIX + "near_misses"] = len(data["near_misses"])
    flat.update({f"{PREFIX}declined/{reason}": n for reason, n in sorted(data["declined_by_reason"].items())})
    return flat


class _Callback:
    def __init__(self) -> None:
        if _Base is None:
            raise ImportError("fx_passes.SummaryCallback is a transformers TrainerCallback: "
                              "pip install transformers")
        self.logged = False

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> None:
        """Add the summary to the first log after the passes looked at a graph."""
        if self.logged or logs is None:
            return
        data = summary()
        if not (data["graphs_compiled"] or data["counters"]):
            return  # nothing compiled yet: wait for a later log
        flat = flat_summary(data)
        logs.update(flat)
        history = getattr(state, "log_history", None)
        if history:
            history[-1].update(flat)
        self.logged = True


if _Base is None:
    class SummaryCallback(_Callback):
        """A TrainerCallback that logs :func:`fx_passes.summary` once (the module docstring)."""
else:
    class SummaryCallback(_Callback, _Base):  # type: ignore[no-redef]
        """A TrainerCallback that logs :func:`fx_passes.summary` once (the module docstring)."""
