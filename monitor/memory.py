"""Allocator settings for a process that handles large records.

glibc serves allocations above a threshold (128 KiB at first) with fresh ``mmap``
mappings and returns freed memory at the top of the heap to the kernel. A consumer of
100 KiB–MiB records then faults in fresh pages for every fetch buffer and every copy of
a record: measured here, about 90 page faults per 129 KiB record, a quarter of the
consumer's CPU time. With large allocations served from the heap and freed memory kept
for reuse, the faults disappear.

The price is that resident memory stays at its peak instead of shrinking after a burst;
the service's fetch sizes bound that peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc's largest allowed mmap threshold on 64-bit systems
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 256 * 1024 * 1024


def reuse_freed_memory() -> bool:
    """Keep freed memory for reuse (glibc only); True if the allocator took it."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        log.warning("the C allocator refused the large-record settings; continuing with its defaults")
    return bool(done)
