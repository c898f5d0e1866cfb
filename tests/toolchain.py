"""The test suite's C++ toolchain: Inductor's kernels linked by gold (``tests/bin/g++``).

Most of the suite's time is Inductor compiling C++ kernels, one g++ process per kernel
(about 1.0 CPU-s each on a 2-core AMD EPYC, some two thousand of them in ``make test``).
A third of a kernel's compile is linking its shared object against libtorch_cpu.so, which
GNU ld does in 0.35 CPU-s and gold in 0.12 s.  Where ``CXX`` is unset and g++ can link with
gold, ``CXX`` points Inductor (and every process a test starts) at ``tests/bin/g++``, which
adds ``-fuse-ld=gold`` to the link and changes nothing else: the same code, flags,
optimisation level and libraries.  A ``CXX`` of your own is left as it is.

Imports nothing but the standard library: ``tests/conftest.py`` calls it before torch is
imported (Inductor reads ``CXX`` once, when its config module loads).
"""

from __future__ import annotations

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
