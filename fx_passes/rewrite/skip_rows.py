"""Leave out of a call's loop the rows a mask leaves unread, where its results stay in the graph.

``skip_unread_rows``: a fused lm_head call whose per-token results the graph keeps becomes
``lm_head_row_stats_masked``; ``skip_unread_region_rows``: a ``row_local_sweeps`` call becomes
``row_local_sweeps_masked``; each with the skip graph of the results' readers (NOTE [per-token
rows a mask leaves out], NOTE [row-local rows a mask leaves unread]), and where none is found
the reason in the log (NOTE [why every row runs]).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, Node

from ..config import Config
from ..fx.graph_ops import bound_args, meta
from ..fx.placement import movable_before
from ..kernels.log_softmax.lm_head_masked import lm_head_row_stats_masked
from ..kernels.ops import user_bodies
from ..kernels.row_local.masked import row_local_sweeps_masked
from ..match.body_mask import skip_rows_of_region_reads
from ..match.loss_tail import NoTail, match_reads, match_region_reads
from ..match.masks import masks_among
from ..match.row_mask import skip_rows_of_reads
from ..reporting.report import log
from .group_sums import Regrouped, committed, match_regrouped

__all__ = ["skip_unread_rows", "skip_unread_region_rows"]


def skip_unread_rows(graph: Graph, stats: Node, config: Config, why: Optional[list[str]] = None) -> bool:
    """Make the fused call ``stats``, which keeps its per-token results,
    ``lm_head_row_stats_masked`` with the skip graph of their readers
    (``match/row_mask.skip_rows_of_reads``: rows a mask leaves unread are left out of its
    loop); False where it has none (the reason logged at debug level; where the reads have
    a mask, appended to ``why`` too: NOTE [why every row runs])."""
    if not config.skip_masked_rows:
        return False

    regrouped: list[Regrouped] = []  # (sums per sequence as sums over the rows: NOTE [per-sequence sums])

    def find(said: list[str]) -> Optional[tuple[str, list[Node]]]:
        if len(stats.args) > 10:  # (``returned_like``: the graph returns the logits, every row)
            raise NoTail("the graph returns its logits")
        tail, done = match_regrouped(graph, stats, lambda ignore: match_reads(graph, stats, ignore))
        regrouped.extend([done] if done is not None else [])
        return skip_rows_of_reads(tail, said)
    return _kept(regrouped, _masked_call(graph, stats, find, lm_head_row_stats_masked, why))


def skip_unread_region_rows(graph: Graph, call: Node, rows: tuple, whole: tuple, config: Config,
                            why: list[str], masked: bool = False) -> bool:
    """Make the ``row_local_sweeps`` call ``call``, whose per-row results the graph keeps,
    ``row_local_sweeps_masked`` with the skip graph of the body and the results' readers
    (``match/body_mask.skip_rows_of_region_reads``: NOTE [row-local rows a mask leaves
    unread]; ``rows``, ``whole``: the body's input specs, the logits' among the rows);
    False where it has none (as :func:`skip_unread_rows`; ``masked``: the region is
    known to have a mask, so the reason is said whatever stops the match)."""
    if not config.skip_masked_rows:
        return False
    args = bound_args(call)  # (row_local_sweeps' parameters)
    key, n, index, inputs = args["key"], args["n_rows"], args["index"], list(args["inputs"])
    device = getattr(meta(args["hidden"]), "device", None)
    if device is not None and device.type != "cpu":  # (NOTE [row-local rows a mask leaves unread])
        reason = (f"on {device.type} this call runs every row: its backward would read the skipped rows' "
                  "cotangents and the count from the device, two more syncs a step")
        log.debug("chunked_logits: %s: every row runs: %s", call.name, reason)
        if masked:
            why.append(reason)
        return False

    regrouped: list[Regrouped] = []  # (as skip_unread_rows)

    def find(said: list[str]) -> Optional[tuple[str, list[Node]]]:
        n_out = len(next(iter(user_bodies.function(key).graph.find_nodes(op="output"))).args[0])
        tail, done = match_regrouped(graph, call, lambda ignore: match_region_reads(graph, call, n_out,
                                                                                    ignore=ignore))
        regrouped.extend([done] if done is not None else [])
        nodes = [*inputs[:index], None, *inputs[index:n - 1]]
        masks = {i for i, o in enumerate(nodes) if o is not None and o in masks_among(tail, [o])}
        return skip_rows_of_region_reads(key, index, rows, whole, tail, masks, said)
    return _kept(regrouped, _masked_call(graph, call, find, row_local_sweeps_masked, why, masked))


def _kept(regrouped: list[Regrouped], masked: bool) -> bool:
    """The sums per sequence written as sums over the rows kept where rows are skipped
    (counted), else the user's again; returns ``masked``."""
    for done in regrouped:
        if masked:
            committed(done)
        else:
            done.undo()
    return masked


def _masked_call(graph: Graph, call: Node, find, target, why: Optional[list[str]],
                 masked: bool = False) -> bool:
    """Retarget ``call`` to its masked op ``target`` with the skip graph ``find(said)``
    gives (its key and the nodes it reads; None, or :class:`NoTail`, where it has none:
    logged, and said in ``why`` where ``said`` shows the reads have a mask, or
    ``masked``)."""
    said: list[str] = []  # (non-empty once the reads are known to have a mask)
    try:
        found = find(said)
        if found is None:
            raise NoTail(said[0] if said else "no mask leaves a row's results unread")
        said.append("")  # (a mask: the reasons below are said too)
        key, read = found
        if any(not isinstance(meta(o), torch.Tensor) for o in read):
            raise NoTail("the mask reads a number")
        early = _earlier(graph, call, read)
    except NoTail as reason:
        log.debug("chunked_logits: %s: every row runs: %s", call.name, reason)
        if (said or masked) and why is not None:
            why.append(str(reason))
        return False
    for n in early:
        call.prepend(n)
    call.target = target
    call.kwargs = {**call.kwargs, "mask_key": key, "mask_operands": list(read)}
    return True


def _earlier(graph: Graph, stats: Node, read: list[Node]) -> list[Node]:
    """The nodes to move before ``stats`` (in order) so that ``read`` are computed before
    it (``fx/placement.movable_before``: a mask's ``.float()``, ``> 0``); or :class:`NoTail`."""
    moved = movable_before(graph, stats, read)
    if isinstance(moved, str):
        raise NoTail(f"the mask is computed after the region: {moved}")
    return moved
