"""Process memory as the kernel sees it: VmRSS, VmHWM and a resettable high-water mark.

``reset_peak()`` writes "5" to /proc/self/clear_refs, which sets VmHWM back to the
current VmRSS (Linux >= 4.0).  The peak of a region of code is then
``VmHWM`` read after it minus ``VmRSS`` read before it.
"""

from __future__ import annotations

import ctypes
import gc

MIB = 1024 * 1024

# Fixed malloc thresholds for the memory runs (set in the child's environment by
# run.py): every allocation of 64 KiB or more is its own mmap, returned to the
# kernel on free, so a freed buffer cannot be reused from a retained heap and hide
# a new allocation from VmHWM.  (Setting the threshold also turns off glibc's
# dynamic threshold, which otherwise grows up to 32 MiB after the first frees.)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}


def status_bytes(field: str) -> int:
    """A ``Vm*`` field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def rss() -> int:
    return status_bytes("VmRSS")


def hwm() -> int:
    return status_bytes("VmHWM")


def reset_peak() -> None:
    """Set the high-water mark VmHWM back to the current VmRSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def release() -> None:
    """Free what Python and malloc still hold, so VmRSS is a clean baseline."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass
