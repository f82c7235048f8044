"""Host memory as the OS counts it: this process's resident set, and handing freed heap back to the system.

Shared by the engine (released weights) and the training rank (offloaded state), which both must show a real
drop in resident memory when they free something. No torch import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path


def resident_bytes() -> int:
    """This process's resident set, from /proc (0 where there is no /proc)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def trim_host_heap() -> None:
    """Give freed heap pages back to the system (glibc keeps them unless asked). Tensors dropped by reference
    count are freed already; a caller that may hold them in cycles collects garbage first."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): the allocator returns memory its own way
        return
    trim(0)
