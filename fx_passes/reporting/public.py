"""``fx_passes.summary()`` and ``fx_passes.summary_text()``: what the passes did in this
process so far, counted per source region.

A region is a place in the user's source (the file and line of its upcast) plus its rank
among the regions at that place in one graph: a function compiled static and then dynamic,
or recompiled for a new shape, is one region seen by several compiles, while two calls of
one loss function in one graph are two.  The exit summary (:mod:`.summary`) counts the same
way.  This module imports no torch.
"""

from __future__ import annotations

from typing import Any

from . import summary as exit_summary
from .summary import regions

__all__ = ["summary", "summary_text"]


def from_data(data: dict[str, Any]) -> dict[str, Any]:
    """The summary's dict from what :func:`.summary.collect` gathered."""
    found = regions(data["events"])

    def of(kind: str) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k != "kind" and (k != "reason" or kind == "declined")}
                for r in found if r["kind"] == kind]

    declined, by_reason = of("declined"), {}
    for r in declined:
        by_reason[r["reason"]] = by_reason.get(r["reason"], 0) + 1
    rewritten, would, stock = of("rewritten"), of("would_rewrite"), of("left_to_stock")
    return {
        "regions_rewritten": len(rewritten),
        "regions_would_rewrite": len(would),
        "regions_left_to_stock": len(stock),
        "regions_declined": len(declined),
        "declined_by_reason": by_reason,
        "near_misses": [{"where": r["where"], "message": r["what"]} for r in of("near_miss")],
        "estimated_bytes_avoided": sum(r["bytes_avoided"] for r in rewritten),
        "rows_seen": data["counters"].get("rows_seen", 0),
        "rows_skipped": data["counters"].get("rows_skipped", 0),
        "masked_rows_not_skipped": data["counters"].get("masked_rows_not_skipped", 0),
        "rewritten": rewritten,
        "would_rewrite": would,
        "left_to_stock": stock,
        "declined": declined,
        "graphs_compiled": data["graphs_seen"],
        "pass_failed": data["counters"].get("pass_failed", 0),
        "installed": data["installed"],
        "disabled": data["disabled"],
        "counters": data["counters"],
    }


def summary() -> dict[str, Any]:
    """What the passes did in this process so far, as plain data (JSON-ready).

    Counted per source region, not per compile (the module docstring).  Keys:

    * ``regions_rewritten``, ``regions_would_rewrite`` (``report_only``),
      ``regions_left_to_stock`` (rewritable, but stock runs them as well: ``match/worth.py``),
      ``regions_declined``: counts of regions;
    * ``declined_by_reason``: ``{Reason name: regions}``;
    * ``near_misses``: ``[{"where", "message"}]``, hints naming what to change;
    * ``estimated_bytes_avoided``: per call, summed over the rewritten regions: the FP32
      ``[.., V]`` tensor stock Inductor would keep (0 where it keeps none either: a
      cross-entropy on given logits) plus the model-precision logits of a fused lm_head;
      0 for a region of symbolic size;
    * ``rows_seen`` / ``rows_skipped``: rows the loops with a loss-tail mask ran over, and
      those left out because the loss zeroes them (``Config.skip_masked_rows``), per step;
    * ``masked_rows_not_skipped``: rewrites whose loss has a mask but runs every row (per
      compile); the region's ``what`` says why (an op with no rule, a result read unmasked,
      a call with no masked variant: logits kept whole, vocab-parallel stages);
    * ``rewritten`` / ``would_rewrite`` / ``left_to_stock`` (its ``what`` ends with why):
      ``[{"where", "what", "bytes_avoided", "compiles"}]``;
      ``declined``: the same plus ``"reason"``;
    * ``graphs_compiled``: graphs the passes looked at; ``pass_failed``: graphs compiled
      unchanged after an error inside the pass;
    * ``installed`` (:func:`fx_passes.install` ran), ``disabled`` (``CHUNKED_LOGITS_DISABLE``),
      ``counters``: the raw ``chunked_logits`` counters, per compile.
    """
    return from_data(exit_summary.collect())


def summary_text() -> str:
    """The exit summary's text for this process so far (what the launcher prints at exit)."""
    return exit_summary.format_text(exit_summary.collect())
