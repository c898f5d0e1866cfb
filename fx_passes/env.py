"""Every environment variable the package reads or sets: the names and their parsing.

This module imports no torch (and nothing of this package at import time): the
environment switch imports it at interpreter start, in every Python process.

* ``CHUNKED_LOGITS``: ``1`` / ``true`` / ``yes`` / ``on`` turns the pass on for the
  stock ``inductor`` backend in any process (through ``chunked_logits.pth``).
* ``CHUNKED_LOGITS_DISABLE``: the kill switch; wins over everything, the backend too.
* ``CHUNKED_LOGITS_OPTIONS``: Config fields, as JSON (``{"report_only": true}``) or
  as a comma list (``report_only,no_temperature_after_upcast,strict=0``).
* ``CHUNKED_LOGITS_SUMMARY``: when to print the exit summary: ``auto`` (default:
  when something was rewritten or declined), ``always``, ``never``.
* ``CHUNKED_LOGITS_SUMMARY_RANKS``: ``0`` (default: only rank 0 prints) or ``all``.
* ``CHUNKED_LOGITS_SUMMARY_DIR``: also write each rank's summary to its own file there.
* ``CHUNKED_LOGITS_SUMMARY_JSON``: write counters and events as JSON to this path
  (``{rank}`` and ``{pid}`` are replaced).
* ``RANK`` (or ``SLURM_PROCID``, ``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``): this
  process's rank, read only to decide which rank prints the summary.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

__all__ = ["SWITCH", "KILL_SWITCH", "OPTIONS", "SUMMARY", "SUMMARY_RANKS", "SUMMARY_DIR",
           "SUMMARY_JSON", "SUMMARY_MODES", "switch_on", "disabled", "options", "export",
           "summary_settings", "summary_ranks", "rank", "without_ours"]

SWITCH = "CHUNKED_LOGITS"
KILL_SWITCH = "CHUNKED_LOGITS_DISABLE"
OPTIONS = "CHUNKED_LOGITS_OPTIONS"
SUMMARY = "CHUNKED_LOGITS_SUMMARY"
SUMMARY_RANKS = "CHUNKED_LOGITS_SUMMARY_RANKS"
SUMMARY_DIR = "CHUNKED_LOGITS_SUMMARY_DIR"
SUMMARY_JSON = "CHUNKED_LOGITS_SUMMARY_JSON"
RANKS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")

SUMMARY_MODES = ("auto", "always", "never")
TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off"}


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in TRUE


def switch_on() -> bool:
    """``CHUNKED_LOGITS`` is set to a true value."""
    return _flag(SWITCH)


def disabled() -> bool:
    """The kill switch ``CHUNKED_LOGITS_DISABLE`` is set."""
    return _flag(KILL_SWITCH)


def without_ours(**extra: str) -> dict[str, str]:
    """This process's environment without the package's variables (``CHUNKED_LOGITS*``),
    plus ``extra``: what a child process that knows nothing of chunked-logits sees (the
    benchmarks' and tests' stock runs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SWITCH)}
    env.update(extra)
    return env


# --- CHUNKED_LOGITS_OPTIONS ------------------------------------------------------------

def _parse_value(key: str, text: str, fields: dict[str, Any]) -> Any:
    low = text.strip().lower()
    default = fields.get(key)
    if isinstance(default, bool):
        if low in TRUE:
            return True
        if low in FALSE:
            return False
        raise ValueError(f"{OPTIONS}: {key} must be 1/0, true/false, yes/no or on/off, got {text!r}")
    try:
        value = json.loads(text)
    except ValueError:
        return text.strip()
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    return value


def options(text: Optional[str] = None) -> dict[str, Any]:
    """``CHUNKED_LOGITS_OPTIONS`` (or ``text``) as a dict of Config fields.

    JSON (``{"report_only": true}``) or a comma list: ``report_only``,
    ``no_temperature_after_upcast``, ``strict=0``; dashes and underscores are alike.
    """
    import dataclasses

    from .config import Config  # torch-free too; imported only when options are read

    text = os.environ.get(OPTIONS, "") if text is None else text
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError(f"{OPTIONS} must be a JSON object, got {text!r}")
        return value
    fields = {f.name: f.default for f in dataclasses.fields(Config)}
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if sep:
            out[key] = _parse_value(key, value, fields)
        elif key.startswith("no_") and key not in fields and key[3:] in fields:
            out[key[3:]] = False
        else:
            out[key] = True
    return out


def export(config_fields: dict[str, Any]) -> None:
    """Turn the switch on with these Config fields for this process's Python children."""
    os.environ[SWITCH] = "1"
    os.environ[OPTIONS] = json.dumps(config_fields)


# --- the exit summary ------------------------------------------------------------------

def summary_ranks() -> Optional[str]:
    """``CHUNKED_LOGITS_SUMMARY_RANKS``, or None when unset."""
    return os.environ.get(SUMMARY_RANKS, "").strip() or None


def summary_settings() -> dict[str, Optional[str]]:
    """The summary's settings from the environment, as ``summary.configure`` arguments
    (None: not set there; an unknown mode counts as not set)."""
    mode = os.environ.get(SUMMARY, "").strip().lower() or None
    if mode in TRUE:
        mode = "always"
    elif mode in FALSE:
        mode = "never"
    return {"mode": mode if mode in SUMMARY_MODES else None, "ranks": summary_ranks(),
            "directory": os.environ.get(SUMMARY_DIR), "json_path": os.environ.get(SUMMARY_JSON)}


def rank() -> Optional[int]:
    """This process's rank in a multi-process job, or None outside one."""
    for var in RANKS:
        value = os.environ.get(var)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None
