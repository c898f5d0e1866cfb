"""The pass pipeline on one Dynamo graph, with fault containment: the named passes of
:data:`PASSES`, in order (each rewrite returns an ``Outcome``; ``reporting.outcome.counted``
turns it into counters and the log line)::

    canonical       torch_names, out_of_place, merge_row_slices (same program, plainer spelling)
    vocab_parallel  find_shard_regions -> rewrite_shard_region (each region)
    regions         find_regions -> rewrite_region, else rewrite_row_region (each region);
                    rewrite_loss_tail on each lm_head call a rewrite fused
    canonical_kept  the graph's own spelling back where no region was rewritten
    div_by_one      remove_div_by_one

Runs on a copy of the graph: if anything inside raises, the caller gets the
original graph back untouched (unless ``Config.strict``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import pathlib
from typing import Callable, Optional

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, GraphModule, Node

from . import compat, env
from .config import Config
from .distributed.shard_stages import find_shard_regions, rewrite_shard_region
from .fx.graph_ops import graph_snapshot, meta, restore_graph
from .kernels.ops.registry import cacheable_names
from .match.graph_break import returned_at_break, taken_after_break
from .match.near_miss import custom_function, loss_outside
from .match.region import Role
from .match.region import where as _where
from .match.row_local import find_row_region
from .match.upcast import upcast_ancestor, upcast_behind, upcast_input
from .match.upcast_regions import Region, find_regions
from .match.worth import left_to_stock
from .reporting.containment import contained
from .reporting.outcome import LMHead, Outcome, counted
from .reporting.report import (
    COUNTER,
    Decline,
    Reason,
    log,
    record_decline,
    record_left_to_stock,
    record_rewrite,
)
from .reporting.session import session
from .rewrite.in_place import out_of_place
from .rewrite.loss_tail import fused_calls, keep_logits, rewrite_loss_tail
from .rewrite.numpy_names import torch_names
from .rewrite.row_local import rewrite_row_region
from .rewrite.row_slices import merge_row_slices
from .rewrite.skip_rows import skip_unread_rows
from .rewrite.slice_first import Moves, slice_first, sliced_upcasts
from .rewrite.unit_scale import remove_div_by_one
from .rewrite.upcast_region import fp32_bytes, rewrite_region

__all__ = ["run_passes", "transform", "ChunkedLogitsPass", "source_hash", "PASSES"]

# Marks a graph this package has already transformed, so that the backend plus an
# installed pre-grad pass (or two installs) rewrite each region once.
_DONE = "_chunked_logits_done"


@dataclasses.dataclass
class _Run:
    """What the passes of one run tell each other."""

    shard_upcasts: set[Node] = dataclasses.field(default_factory=set)  # seen by vocab_parallel
    taken: set[Node] = dataclasses.field(default_factory=set)  # nodes of row-local regions rewritten or left
    declined: set[Node] = dataclasses.field(default_factory=set)  # roots and upcasts of regions declined
    # the graph before ``canonical`` changed it, what it changed, and the rewrites counted then
    canonical: Optional[tuple[Graph, dict[str, int], int]] = None


def _vocab_parallel(graph: Graph, config: Config, run: _Run) -> None:
    """Vocab-parallel regions (reductions over a vocabulary shard that feed collectives):
    rewrite each; the upcasts seen go to ``run``, so that the single-process matcher skips them."""
    seen = run.shard_upcasts
    for found in find_shard_regions(graph):
        if isinstance(found, tuple):
            seen.add(found[0])
            record_decline(_where(found[0]), found[1])
            continue
        seen.add(found.upcast)
        where, what, nbytes = _where(found.upcast), found.describe(), fp32_bytes(found.upcast)
        if config.report_only or not config.rewrite:
            record_rewrite(where, what, nbytes, report_only=True)
            continue
        try:
            outcome = rewrite_shard_region(graph, found, config)
        except Decline as d:  # raised before the graph is touched
            record_decline(where, d)
            continue
        counters[COUNTER]["vocab_parallel"] += 1
        record_rewrite(where, counted(outcome, what, "vocab_parallel_lm_head"), nbytes, report_only=False)


def _stock_keeps_fp32(region: Region) -> bool:
    """Does stock Inductor keep the region's FP32 ``[.., V]`` tensor (anything but a
    cross-entropy alone, whose fused kernels keep none), whatever its sizes?"""
    return {s.role for s in region.sinks} != {Role.LOSS}


def _bytes_avoided(region: Region) -> tuple[int, int]:
    """What stock Inductor keeps per call that a rewrite of ``region`` does not (0 if
    symbolic), read before the rewrite: the FP32 ``[.., V]`` tensor, except for a
    cross-entropy alone (stock's fused kernels keep none either); and the model-precision
    logits, which a fused lm_head also never makes."""
    nbytes = fp32_bytes(region.z) if _stock_keeps_fp32(region) else 0
    logits = upcast_input(region.upcast)
    value = meta(logits) if logits is not None else None
    numel = value.numel() if isinstance(value, torch.Tensor) else None
    return nbytes, numel * value.element_size() if isinstance(numel, int) else 0


def _with_lm_head(nbytes: tuple[int, int], outcome: Outcome) -> int:
    """The bytes avoided: the model-precision logits too where the fused call neither
    returns nor keeps them (``kept_logits``: NOTE [kept logits])."""
    fused = outcome.lm_head is LMHead.FUSED and not outcome.returns_logits and not outcome.kept_logits
    return nbytes[0] + (nbytes[1] if fused else 0)


# What the hand-derived path declines that a row-local region may still take: an op it
# does not know, loss options, several indices, a per-row temperature, results it does
# not read ...  (not: logits that are not model precision, DTensors, mutations, states).
ROW_LOCAL_RETRIES = {Reason.UNKNOWN_OP, Reason.LOSS_OPTIONS, Reason.ESCAPES, Reason.SEVERAL_INDICES,
                     Reason.INDEX_SHAPE, Reason.NOT_LAST_DIM, Reason.TEMPERATURE, Reason.ORDER}


def _row_local(graph: Graph, node: Node, decline: Decline, config: Config, taken: set[Node],
               declined: set[Node]) -> None:
    """A region the hand-derived path declined (``decline`` at ``node``): rewrite it as a
    row-local region (:mod:`fx_passes.match.row_local`) or record why not (and add its
    upcast to ``declined``)."""
    if node in taken:
        return  # absorbed by a row-local region already (a teacher's upcast)
    seed = node if upcast_input(node) is not None else upcast_behind(node)
    declined.update(filter(None, (node, seed)))
    if not config.row_local or decline.reason not in ROW_LOCAL_RETRIES or seed is None or seed in taken:
        record_decline(_where(node), decline)
        return
    moves = Moves()  # (logits.float()[:-1]: the slice first, a teacher's too; NOTE [slice first])
    start = moves.add(slice_first(graph, seed))
    start = start.seed if start is not None else seed
    try:
        region = find_row_region(graph, start)
        if [moves.add(slice_first(graph, up)) for up in sliced_upcasts(region.rows)] and moves.made:
            region = find_row_region(graph, start)
        where, what, nbytes = _where(seed), region.describe(), sum(fp32_bytes(s) for s in region.seeds)
        why = left_to_stock(region) if config.leave_to_stock else None
        if why is not None or config.report_only or not config.rewrite:
            moves.undo(Decline(Reason.NOT_ROW_LOCAL, ""))
            if why is None:
                record_rewrite(where, what, nbytes, report_only=True)
                return
            declined.difference_update((node, seed))  # (can, but should not: one region, one outcome)
            taken.update([*region.nodes, *moves.old])
            record_left_to_stock(where, what, why, config.report_only or not config.rewrite)
            return
        outcome = rewrite_row_region(graph, region, config)
    except Decline as d:  # raised before the graph is touched (but for the moves, undone)
        d = moves.undo(d)
        # (the same reason twice: the hand-derived path's words, which docs/declines.md shows)
        record_decline(_where(node), decline if d.reason is decline.reason else d)
        return
    declined.difference_update((node, seed))
    taken.update([*region.nodes, *moves.old])
    moves.finish()
    counters[COUNTER]["row_local"] += 1
    record_rewrite(where, counted(outcome, what, "row_local_lm_head"), nbytes, report_only=False)


def _handled(found: Region | tuple[Node, Decline], upcasts: set[Node]) -> bool:
    node = found.upcast if isinstance(found, Region) else found[0]
    return node in upcasts or (upcast_input(node) is None and upcast_behind(node) in upcasts)


def _inner(found: Region | tuple[Node, Decline]) -> Optional[Node]:
    """The upcast whose region holds a candidate declined as "FP32 already" (a tensor
    computed from that upcast through ops the matcher does not follow), else None."""
    if isinstance(found, Region) or found[1].reason is not Reason.NOT_LOW_PRECISION:
        return None
    return upcast_ancestor(found[0])


def _inner_last(found: list[Region | tuple[Node, Decline]]) -> list[Region | tuple[Node, Decline]]:
    """Candidates inside another's region after it: taken or declined with it."""
    return sorted(found, key=lambda f: _inner(f) is not None)


def _regions(graph: Graph, config: Config, run: _Run) -> None:
    """Single-process regions: each by the hand-derived path, else as a row-local region,
    else declined with its reason; a fused lm_head call's loss tail computed in the forward."""
    taken, declined = run.taken, run.declined
    taken_after_break(graph)  # (a graph break between the upcast and the loss: near misses)
    returned_at_break(graph)
    custom_function(graph)  # (FP32 logits into a custom autograd.Function)
    candidates = find_regions(graph, config)
    if not candidates and not run.shard_upcasts:
        loss_outside(graph)  # (a near miss when the graph returns logits)
    for found in _inner_last(candidates):
        if run.shard_upcasts and _handled(found, run.shard_upcasts):
            continue
        if isinstance(found, tuple) and (up := _inner(found)) is not None and (
                found[0] in taken or up in taken or up in declined):
            log.debug("chunked_logits: %s is inside the region of %s", found[0].name, up.name)
            continue  # (one region, one outcome: no second decline for a tensor inside it)
        if isinstance(found, tuple):
            _row_local(graph, found[0], found[1], config, taken, declined)
            continue
        region: Region = found
        if taken and (region.upcast in taken or any(n in taken for n in region.roles)):
            continue  # (its nodes went into a row-local region)
        _region(graph, region, config, run)


def _region(graph: Graph, region: Region, config: Config, run: _Run) -> None:
    """One region the hand-derived path matched: rewritten (and its loss tail), reported
    only, or handed to the row-local path when the rewrite declines."""
    where, what, nbytes = _where(region.upcast), region.describe(), _bytes_avoided(region)
    if config.report_only or not config.rewrite:
        record_rewrite(where, what, nbytes[0], report_only=True)
        return
    if log.isEnabledFor(logging.DEBUG):
        log.debug("chunked_logits: region before rewrite:\n%s",
                  "\n".join(n.format_node() for n in region.roles))
    fused = fused_calls(graph)
    try:
        outcome = rewrite_region(graph, region, config)
    except Decline as d:  # raised before the graph is touched
        _row_local(graph, region.upcast, d, config, run.taken, run.declined)
        return
    new = sorted(fused_calls(graph) - fused, key=lambda n: n.name)
    stock_fp32 = _stock_keeps_fp32(region)
    losses = tuple(filter(None, (rewrite_loss_tail(graph, call, config, stock_fp32)  # (in the forward)
                                 for call in new)))
    kept = [call for call in new if call in fused_calls(graph)]  # (those keeping per-token results)
    why: list[str] = []  # (per-token results a mask leaves unread that every row computes: why)
    masked = sum(skip_unread_rows(graph, call, config, why) for call in kept)
    # (lm_head_plan="kept_logits", or "auto" on a GPU where stock keeps an FP32 [T, V]: the
    # per-token calls still whole keep their logits, NOTE [kept logits], tiling.keeps_logits)
    kept_logits = sum(keep_logits(call, stock_fp32) for call in kept if call in fused_calls(graph))
    outcome = dataclasses.replace(outcome, losses=outcome.losses + losses, masked_per_token=masked,
                                  rows_why=tuple(why), kept_logits=kept_logits)
    record_rewrite(where, counted(outcome, what, "lm_head_fused"), _with_lm_head(nbytes, outcome),
                   report_only=False)
    if region.unit_scale_dropped:
        counters[COUNTER]["div_by_one_removed"] += 1


def _div_by_one(graph: Graph, config: Config, run: _Run) -> None:
    """Divisions and multiplications by 1 (a temperature of 1) removed."""
    if config.remove_div_by_one and not config.report_only:
        n = remove_div_by_one(graph)
        if n:
            counters[COUNTER]["div_by_one_removed"] += n
            log.info("chunked_logits: removed %d division(s)/multiplication(s) by 1", n)


def _canonical(graph: Graph, config: Config, run: _Run) -> None:
    """Spellings the matchers read as their plain forms: NumPy's argument names on torch's
    ops in torch's, in-place maths on a fresh FP32 copy made out of place, loops over the
    rows merged (each the same program).  Kept only where a region is then rewritten
    (``_canonical_kept``)."""
    if config.report_only or not config.rewrite:
        return
    snapshot = graph_snapshot(graph)
    done = {"numpy_names_renamed": torch_names(graph), "in_place_made_out_of_place": out_of_place(graph),
            "row_slices_merged": merge_row_slices(graph)}
    if any(done.values()):
        run.canonical = (snapshot, done, counters[COUNTER]["rewritten"])


def _canonical_kept(graph: Graph, config: Config, run: _Run) -> None:
    """The graph as the user wrote it again when ``canonical`` changed it and no region was
    rewritten after: a spelling changed for nothing is not left behind."""
    if run.canonical is None:
        return
    snapshot, done, rewritten = run.canonical
    if counters[COUNTER]["rewritten"] == rewritten:
        restore_graph(graph, snapshot)
        log.info("chunked_logits: no region rewritten; the graph's own spelling kept (%s undone)",
                 ", ".join(f"{name} {n}" for name, n in done.items() if n))
        return
    for name, count in done.items():
        if count:
            counters[COUNTER][name] += count


# The passes of one run, in order (the module's docstring says what each does).
PASSES: tuple[tuple[str, Callable[[Graph, Config, _Run], None]], ...] = (
    ("canonical", _canonical),
    ("vocab_parallel", _vocab_parallel),
    ("regions", _regions),
    ("canonical_kept", _canonical_kept),
    ("div_by_one", _div_by_one),
)


def run_passes(graph: Graph, config: Config) -> None:
    """Apply the passes to ``graph`` in place.  Raises on internal errors."""
    session.start_run()
    run = _Run()
    for name, apply in PASSES:
        log.debug("chunked_logits: pass %s", name)
        apply(graph, config, run)
    graph.lint()


def _copy(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` with its own graph; what Dynamo attached to it (``meta``: the
    compile id, parameter names; ``_param_name_to_source`` ...) comes along."""
    graph, twins = Graph(), {}
    out = graph.graph_copy(gm.graph, twins)
    graph.output(out)
    for old, twin in twins.items():  # Dynamo's per-node attributes (placeholders' sources)
        for name, value in compat.dynamo_node_attributes(old).items():
            if not hasattr(twin, name):
                setattr(twin, name, value)
    new = GraphModule(gm, graph)
    new.meta = dict(gm.meta)
    for name, value in vars(gm).items():
        if name not in vars(new) and not name.startswith("__"):
            setattr(new, name, value)
    return new


def transform(gm: GraphModule, config: Config) -> GraphModule:
    """The transformed copy of ``gm``; the original on any internal error."""
    if getattr(gm, _DONE, False):
        return gm
    with contained(config.strict) as attempt:
        new = _copy(gm)
        run_passes(new.graph, config)
        new.recompile()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("chunked_logits: graph after the passes:\n%s", new.code)
    if attempt.failed:
        return gm
    setattr(new, _DONE, True)
    return new


# The functions a rewritten graph calls, each registered where it is defined
# (``kernels.ops.registry.emitted``; NOTE [emitted functions]).  AOTAutograd's cache stores only
# graphs whose calls it can vouch for; these are marked cacheable (Inductor's
# ``unsafe_marked_cacheable_functions``) with a value that changes with this package's
# sources (the value is part of the cache key), so a warm start reuses the compiled
# forward and backward and a changed package never gets stale ones.
def cacheable() -> tuple[str, ...]:
    """The names :func:`with_cacheable_marks` marks: every registered emitted function."""
    return cacheable_names()


def with_cacheable_marks(marked: dict[str, str]) -> dict[str, str]:
    """``marked`` (a value of ``unsafe_marked_cacheable_functions``) plus our marks."""
    return {**marked, **dict.fromkeys(cacheable(), f"chunked_logits-{source_hash()[:16]}")}


PACKAGE = pathlib.Path(__file__).parent


def source_hash(root: pathlib.Path | None = None) -> str:
    """Hash of the package's source files (every stage's folder) under ``root`` (this
    package's, hashed once per process): part of every cache key the pass gives."""
    return _package_hash() if root is None else _hash(pathlib.Path(root))


@functools.lru_cache(None)
def _package_hash() -> str:
    return _hash(PACKAGE)


def _hash(root: pathlib.Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class ChunkedLogitsPass(CustomGraphPass):
    """The passes as an Inductor ``pre_grad_custom_pass`` (it gets a Dynamo graph)."""

    def __init__(self, config: Config | None = None) -> None:
        if config is not None and not isinstance(config, Config):
            raise TypeError(
                f"ChunkedLogitsPass takes a fx_passes.Config, got {type(config).__name__} "
                f"{config!r}; e.g. ChunkedLogitsPass(Config.from_options({{'strict': True}}))"
            )
        self.config = config or Config()

    def __call__(self, graph: Graph) -> None:
        gm = graph.owning_module
        if env.disabled() or (gm is not None and getattr(gm, _DONE, False)):
            return
        snapshot = _copy(gm) if gm is not None else None
        # without a module to copy there is nothing to restore: an error propagates
        with contained(self.config.strict or snapshot is None) as attempt:
            run_passes(graph, self.config)
        if attempt.failed:
            restore_graph(graph, snapshot.graph)
        if gm is not None:
            setattr(gm, _DONE, True)

    def uuid(self) -> str:
        state = "off" if env.disabled() else "on"
        return f"chunked_logits-{source_hash()[:16]}-{self.config.key()}-{state}"
