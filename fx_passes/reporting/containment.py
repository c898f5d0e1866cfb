"""Fault containment: an error inside the passes never breaks a user's compile.

    with contained(config.strict) as attempt:
        ...                      # run the passes, or compile the rewritten graph
    if attempt.failed:
        ...                      # fall back to the untouched graph

On an error inside the block the counters and events go back to what they were when
the containment was created (the untouched graph is compiled, so nothing was
rewritten), ``pass_failed`` is counted, a warning names what failed and the
``fx_passes`` log gets the traceback; the error is swallowed.  Under
``strict`` it propagates.  Dynamo's restart requests are control flow, not
failures, and ``KeyboardInterrupt`` / ``SystemExit`` are not errors of the pass:
they always propagate, untouched.
"""

from __future__ import annotations

import traceback
import warnings
from typing import Any, Optional

from torch._dynamo.utils import counters

from .. import compat
from .report import COUNTER, log
from .session import session

__all__ = ["contained", "Containment"]

_PASS_FAILED = "the pass failed on this graph"


class Containment:
    """The snapshot of one attempt and, after the block, whether it failed."""

    def __init__(self, strict: bool, what: str, short: str) -> None:
        self.strict, self.what, self.short = strict, what, short
        self.failed = False
        self._counts = dict(counters[COUNTER])
        self._mark = session.mark()

    def __enter__(self) -> "Containment":
        return self

    def __exit__(self, kind: Optional[type], error: Optional[BaseException], tb: Any) -> bool:
        if error is None or not isinstance(error, Exception):
            return False
        if self.strict or isinstance(error, compat.CONTROL_FLOW_ERRORS):
            return False
        self._rollback()
        counters[COUNTER]["pass_failed"] += 1
        # stacklevel 3: this frame, the function holding the ``with``, then its caller
        warnings.warn(f"chunked_logits: {self.what}; compiling it unchanged with stock Inductor "
                      "(set TORCH_LOGS=fx_passes for the traceback)", stacklevel=3)
        log.warning("chunked_logits: %s, graph left unchanged:\n%s", self.short,
                    "".join(traceback.format_exception(kind, error, tb)))
        self.failed = True
        return True

    def _rollback(self) -> None:
        counters[COUNTER].clear()
        counters[COUNTER].update(self._counts)
        session.rollback(self._mark)


def contained(strict: bool, what: str = _PASS_FAILED, short: str = "pass failed") -> Containment:
    """A context manager that contains an error of the passes (see the module docstring).

    The snapshot is taken here, when it is created: create it before everything whose
    counters and events a failure must take back.  ``what`` goes into the warning,
    ``short`` into the log line.
    """
    return Containment(strict, what, short)
