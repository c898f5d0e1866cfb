"""The exit summary of the launcher and the environment switch.

What the passes rewrote and declined in this process (``fx_passes.reporting.session`` and
the ``chunked_logits`` counters), printed once at interpreter exit to stderr as
one write, so that ranks under torchrun do not interleave line by line.  By default
only rank 0 (``RANK`` unset or 0) prints; ``ranks="all"`` makes every rank print
(for torchrun's ``--redirects``/``--log-dir``, one log per rank), and a summary
directory gets one file per rank.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import sys
from typing import Any, Optional

from .. import env
from .session import session

__all__ = ["configure", "settings", "restore", "arm", "arm_from_env", "collect", "regions", "format_text",
           "rank", "write_summary"]

MODES = env.SUMMARY_MODES


@dataclasses.dataclass
class _Settings:
    mode: str = "auto"
    ranks: str = "0"
    directory: Optional[str] = None
    json_path: Optional[str] = None
    locked: bool = False  # set by the launcher: the environment does not override it


_settings = _Settings()
_armed = False


def configure(mode: Optional[str] = None, ranks: Optional[str] = None, directory: Optional[str] = None,
              json_path: Optional[str] = None, lock: bool = False) -> None:
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"summary mode must be one of {MODES}, got {mode!r}")
        _settings.mode = mode
    if ranks is not None:
        if ranks not in ("0", "all"):
            raise ValueError(f"summary ranks must be '0' or 'all', got {ranks!r}")
        _settings.ranks = ranks
    if directory is not None:
        _settings.directory = directory or None
    if json_path is not None:
        _settings.json_path = json_path or None
    _settings.locked = _settings.locked or lock


def settings() -> _Settings:
    """A copy of the summary's settings (``restore`` puts one back)."""
    return dataclasses.replace(_settings)


def restore(saved: _Settings) -> None:
    """Put back settings taken with :func:`settings` (tests, tools that configure twice)."""
    global _settings
    _settings = dataclasses.replace(saved)


def arm() -> None:
    """Print the summary at exit (once, however often this is called)."""
    global _armed
    if not _armed:
        _armed = True
        atexit.register(_at_exit)


def arm_from_env() -> None:
    if not _settings.locked:
        configure(**env.summary_settings())
    arm()


def rank() -> Optional[int]:
    """This process's rank in a multi-process job, or None outside one."""
    return env.rank()


def collect() -> dict[str, Any]:
    """Everything the summary says, as plain data (also what the JSON file holds)."""
    utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing was compiled
    counters = dict(utils.counters.get("chunked_logits", {})) if utils is not None else {}
    installed = session.installed is not None
    return {
        "rank": rank(),
        "pid": os.getpid(),
        "disabled": env.disabled(),
        "installed": installed,
        "pass_dropped": installed and session.pass_dropped(),
        "config": dataclasses.asdict(session.installed) if installed else None,
        "graphs_seen": session.graphs_seen,
        "counters": {k: int(v) for k, v in sorted(counters.items())},
        "events": [{"kind": e.kind, "where": e.where, "what": e.what,
                    "fp32_bytes_avoided": e.fp32_bytes_avoided, "run": e.run,
                    "reason": e.reason.name if e.reason is not None else None}
                   for e in session.events],
    }


def _place(where: str) -> str:
    """The source part of an event's ``where`` ("node (File ..., line N, in f)")."""
    name, sep, rest = where.partition(" (")
    return rest[:-1] if sep and rest.endswith(")") else where


def regions(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The distinct regions of the events (as :func:`collect` lists them), in the
    order first seen: kind, where, what, reason, bytes avoided and how many compiles saw it."""
    out: dict[tuple, dict[str, Any]] = {}
    rank: dict[tuple, int] = {}
    for e in events:
        place = (e.get("run", 0), e["kind"], _place(e["where"]), e["reason"])
        n = rank[place] = rank.get(place, -1) + 1
        key = (e["kind"], _place(e["where"]), e["reason"], n)
        if e["kind"] == "near_miss":
            key = (e["kind"], e["where"], e["what"])  # one per distinct hint
        if key not in out:
            out[key] = {"kind": e["kind"], "where": e["where"], "what": e["what"], "reason": e["reason"],
                        "bytes_avoided": 0, "compiles": 0}
        region = out[key]
        region["compiles"] += 1
        region["bytes_avoided"] = max(region["bytes_avoided"], e["fp32_bytes_avoided"])
    return list(out.values())


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _short(where: str) -> str:
    cwd = os.getcwd() + os.sep
    where = where.replace(cwd, "")
    marker = "site-packages" + os.sep
    while marker in where:
        head, _, tail = where.partition(marker)
        quote = head.rfind('"')
        where = head[:quote + 1] + tail if quote >= 0 else tail
    return where


def format_text(data: dict[str, Any]) -> str:
    who = f"rank {data['rank']}, pid {data['pid']}" if data["rank"] is not None else f"pid {data['pid']}"
    head = f"chunked_logits summary [{who}]"
    if data["disabled"]:
        return f"{head}: disabled by CHUNKED_LOGITS_DISABLE=1; no graph was changed\n"
    # One line per distinct source region (a recompile reports the same region again).
    found = regions(data["events"])
    kinds = [r["kind"] for r in found]
    n_rw, n_would = kinds.count("rewritten"), kinds.count("would_rewrite")
    n_dec, n_near, n_stock = kinds.count("declined"), kinds.count("near_miss"), kinds.count("left_to_stock")
    avoided = sum(r["bytes_avoided"] for r in found if r["kind"] == "rewritten")
    parts = [f"{n_rw} region{'s' if n_rw != 1 else ''} rewritten"]
    if n_would:
        parts.append(f"{n_would} would be rewritten (report_only)")
    if n_stock:
        parts.append(f"{n_stock} left to stock Inductor")
    parts.append(f"{n_dec} declined")
    if n_near:
        parts.append(f"{n_near} near miss{'es' if n_near != 1 else ''}")
    lines = []
    if found:
        lines.append(f"{head}: {', '.join(parts)}; estimated bytes avoided per call: {_size(avoided)}")
    elif data["graphs_seen"] or data["counters"]:
        lines.append(f"{head}: {data['graphs_seen']} graph(s) compiled, no FP32 upcast of bf16/fp16 "
                     "logits into log_softmax/softmax/logsumexp/cross_entropy found")
    else:
        lines.append(f"{head}: no graph was compiled with Inductor in this process; nothing rewritten")
    label = {"rewritten": "rewritten", "would_rewrite": "would rewrite", "declined": "declined",
             "near_miss": "near miss", "left_to_stock": "left to stock"}
    for r in found:
        kind, times = r["kind"], f" (x{r['compiles']} compiles)" if r["compiles"] > 1 else ""
        if kind in ("declined", "near_miss", "left_to_stock"):
            lines.append(f"  {label[kind]:<13} at {_short(r['where'])}{times}")
            lines.append(f"  {'':<13} {r['what']}")
        else:
            size = r["bytes_avoided"]
            avoided = f"{_size(size)} avoided" if size else "nothing avoided"
            lines.append(f"  {label[kind]:<13} {r['what']}, {avoided}{times}")
            lines.append(f"  {'':<13} at {_short(r['where'])}")
    seen, skipped = data["counters"].get("rows_seen", 0), data["counters"].get("rows_skipped", 0)
    if seen:
        lines.append(f"  rows skipped: {skipped} of {seen} ({100 * skipped / seen:.0f}%) that the loss "
                     "leaves out (mask, ignore_index), GEMMs included")
    every_row = data["counters"].get("masked_rows_not_skipped", 0)
    if every_row:
        lines.append(f"  {every_row} rewrite(s) with a mask run every row: the line of each says why")
    failed = data["counters"].get("pass_failed", 0)
    if failed:
        lines.append(f"  the pass failed on {failed} graph(s), which were compiled unchanged "
                     "(TORCH_LOGS=fx_passes shows the traceback)")
    if data["counters"]:
        lines.append("  counters: " + ", ".join(f"{k}={v}" for k, v in data["counters"].items()))
    if data["pass_dropped"]:
        lines.append("  warning: torch._inductor.config.pre_grad_custom_pass was replaced after the install, "
                     "so later compiles ran without the pass; chain your pass instead of assigning it")
    return "\n".join(lines) + "\n"


def _has_content(data: dict[str, Any]) -> bool:
    return bool(data["events"] or data["graphs_seen"] or data["counters"] or data["pass_dropped"])


def write_summary(data: Optional[dict[str, Any]] = None) -> None:
    data = collect() if data is None else data
    text = format_text(data)
    r = data["rank"]
    tag = f"rank{r}" if r is not None else f"pid{data['pid']}"
    if _settings.directory:
        os.makedirs(_settings.directory, exist_ok=True)
        with open(os.path.join(_settings.directory, f"chunked_logits.{tag}.txt"), "w") as f:
            f.write(text)
    if _settings.json_path:
        path = _settings.json_path.replace("{rank}", str(r if r is not None else 0)).replace(
            "{pid}", str(data["pid"]))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
    show = _settings.mode == "always" or (_settings.mode == "auto" and _has_content(data))
    if show and (_settings.ranks == "all" or r in (None, 0)):
        if r is not None and _settings.ranks == "all":
            text = "".join(f"[rank {r}] {line}\n" for line in text.splitlines())
        for stream in (sys.stdout, sys.stderr):  # keep the order of what the script printed
            try:
                stream.flush()
            except Exception:
                pass
        os.write(2, text.encode())


def _at_exit() -> None:
    try:
        write_summary()
    except Exception as e:  # never turn a clean exit into a crash
        try:
            os.write(2, f"chunked_logits: could not write the exit summary: {e!r}\n".encode())
        except Exception:
            pass
