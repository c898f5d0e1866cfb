"""What makes the test processes faster without changing what they test.

Most of the suite's time is Dynamo tracing and Inductor compiling C++ kernels (one g++
process per kernel, about 1.0 CPU-s each on a 2-core AMD EPYC, some two thousand of them in
``make test``).  Three overheads of that are not what the tests are about:

* **Linking.**  A third of a kernel's compile is linking its shared object against
  libtorch_cpu.so, which GNU ld does in 0.35 CPU-s and gold in 0.12 s.  Where ``CXX`` is
  unset and g++ can link with gold, :func:`link_kernels_with_gold` points ``CXX`` (for
  Inductor and every process a test starts) at ``tests/bin/g++``, which adds
  ``-fuse-ld=gold`` to the link and changes nothing else: the same code, flags,
  optimisation level and libraries.  A ``CXX`` of your own is left as it is.
* **Dynamo's guard-latency probe.**  Each new set of guards is checked, then timed once
  for Dynamo's compile metrics after evicting the CPU caches by writing a fresh 32 MiB
  buffer: 23 ms of CPU per compile, nearly all of it the buffer's 8193 page faults (an
  eighth of test_hostile's CPU).  :func:`skip_guard_latency_probe` makes the probe report
  0; nothing in the suite reads that metric, and the guards are built and checked as
  before.
* **Python's cyclic garbage collector** at its default thresholds (700, 10, 10) ran 26
  full collections of 0.3 s each per worker on test_hostile (a tenth of its CPU, with
  the young collections).  :func:`collect_garbage_less_often` raises them; every test
  still starts from ``torch._dynamo.reset()`` (conftest), so what a test leaves is freed.

:func:`link_kernels_with_gold` imports nothing but the standard library:
``tests/conftest.py`` calls it before torch is imported (Inductor reads ``CXX`` once, when
its config module loads).
"""

from __future__ import annotations

import gc
import os
import pathlib
import shutil
import subprocess
import sys

WRAPPER = pathlib.Path(__file__).resolve().parent / "bin" / "g++"


def gold_links() -> bool:
    """Whether the g++ on PATH links with gold (binutils' ``ld.gold``)."""
    if not sys.platform.startswith("linux") or shutil.which("g++") is None:
        return False
    try:
        probe = subprocess.run(["g++", "-fuse-ld=gold", "-Wl,--version"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0 and "GNU gold" in probe.stdout


def link_kernels_with_gold() -> bool:
    """Point ``CXX`` at the wrapper where that helps; whether it did."""
    if "CXX" in os.environ or not gold_links():
        return False
    os.environ["CXX"] = str(WRAPPER)
    return True


def skip_guard_latency_probe() -> bool:
    """Dynamo's per-compile guard-latency probe reports 0 (see the module's docstring);
    whether this torch has the probe where it is looked for."""
    from torch._dynamo import guards

    if not callable(getattr(guards, "profile_guard_manager", None)):
        return False
    guards.profile_guard_manager = lambda *args, **kwargs: 0.0
    return True


# young collections 70x rarer than Python's default, full ones at most one per 1000
# middle-generation collections (and still only once a quarter of the heap is new)
GC_THRESHOLDS = (50_000, 100, 1000)


def collect_garbage_less_often() -> None:
    gc.set_threshold(*GC_THRESHOLDS)
