"""What the passes did in this process: the one owner of the session's events.

``report`` records each rewrite and decline here, the backend and the installed pass
count the graphs they look at, ``install`` notes its config, a contained failure
takes back what the failed run recorded, and the exit summary reads it all through
:data:`session`.  ``session.reset()`` starts over (tests do, between cases).

This module imports no torch: the launcher's summary reads it at exit, in processes
that may never have compiled anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

__all__ = ["Event", "Handoff", "Session", "session"]


@dataclasses.dataclass
class Event:
    kind: str  # "rewritten" | "declined" | "would_rewrite" | "left_to_stock" | "near_miss"
    where: str
    what: str
    fp32_bytes_avoided: int = 0
    reason: Any = None  # a report.Reason (not imported: report imports this module)
    run: int = 0  # which run of the passes recorded it (``Session.runs``): one graph each


@dataclasses.dataclass(frozen=True)
class Handoff:
    """A graph that returned FP32 logits at a graph break (``match.graph_break``)."""

    graph: str  # which compile: "graph 0/0 (step at train.py:12)"
    shape: tuple  # the tensor's shape, each size as text
    made: str  # the upcast: name and source line
    broke_at: str  # the source line(s) of the break
    why: str  # Dynamo's reason, its first line


@dataclasses.dataclass
class Session:
    """Events, graphs seen and the installed config of one process."""

    events: list[Event] = dataclasses.field(default_factory=list)
    graphs_seen: int = 0  # graphs the passes looked at (installed pass and backend)
    runs: int = 0  # runs of the passes (a graph each; also those of fx_passes.transform)
    installed: Any = None  # the Config of the last install(), kept after uninstall()
    handoffs: list[Handoff] = dataclasses.field(default_factory=list)  # FP32 logits returned at a break
    _dropped: Optional[Callable[[], bool]] = None  # install()'s check: was its pass replaced?
    # the last compile the passes saw: its context, its attempt, and what the session and the
    # counters held when that attempt began (a restart follows its abandoned attempt at once)
    _attempt: Optional[tuple] = None

    def record(self, event: Event) -> None:
        event.run = self.runs
        self.events.append(event)

    def start_run(self) -> None:
        """The passes start on a graph: the events until the next start are of that graph."""
        self.runs += 1

    def has(self, kind: str, where: str, what: str) -> bool:
        """Is an event of this kind, place and text recorded already?"""
        return any(e.kind == kind and e.where == where and e.what == what for e in self.events)

    def count_graph(self) -> None:
        self.graphs_seen += 1

    def start_attempt(self, compile: Any, attempt: int, counts: dict) -> Optional[dict]:
        """The passes are about to look at a graph of Dynamo's compile ``compile`` (its
        context object: one per compile, across its attempts), on its ``attempt``;
        ``counts`` are the counters now.  Where Dynamo restarted that compile's analysis
        after the passes ran on an earlier attempt (Inductor specializing a float argument
        does), the abandoned attempt's events, handoffs and graphs are taken back, and the
        counters it began from are returned for the caller to restore (else None): the new
        attempt records them anew.  NOTE [a restarted compile]."""
        prev = self._attempt
        if prev is not None and prev[0] is compile and attempt <= prev[1]:
            return None  # (the same attempt again, e.g. DDP's next bucket: its first snapshot stands)
        back = None
        if prev is not None and prev[0] is compile:
            _, _, events, handoffs, graphs, back = prev
            del self.events[events:]
            del self.handoffs[handoffs:]
            self.graphs_seen = graphs
        self._attempt = (compile, attempt, len(self.events), len(self.handoffs), self.graphs_seen,
                         dict(back if back is not None else counts))
        return back

    def note_installed(self, config: Any, dropped: Callable[[], bool]) -> None:
        """``install(config)`` ran; ``dropped()`` says whether its pass was replaced since."""
        self.installed, self._dropped = config, dropped

    def pass_dropped(self) -> bool:
        return self._dropped is not None and self._dropped()

    def mark(self) -> int:
        """A point to :meth:`rollback` to."""
        return len(self.events)

    def rollback(self, mark: int) -> None:
        """Forget the events recorded after ``mark`` (a failed run's claims)."""
        del self.events[mark:]

    def reset(self) -> None:
        """Start over: no events, no graphs seen, nothing installed noted."""
        self.events.clear()
        self.handoffs.clear()
        self.graphs_seen = self.runs = 0
        self.installed, self._dropped = None, None
        self._attempt = None


session = Session()
