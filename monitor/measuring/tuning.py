"""Process settings for handling many large records: the garbage collector and the C
allocator, applied by the service's process and by each measuring process at start.

The garbage collector (:func:`collect_less`). CPython collects its youngest generation
every 700 allocations, and the whole heap whenever a quarter of it is new since the
last full collection. Each trace waiting for its outcome in the join buffer is a few
objects that live seconds, so they reach the oldest generation, and every full
collection walks the whole heap, including the tens of thousands of objects made while
starting (modules, pydantic and Kafka client internals), which never become garbage.
:func:`collect_less` moves what exists after start out of the collector's reach
(``gc.freeze``) and collects the youngest generation every ``YOUNG_THRESHOLD``
allocations. Garbage without cycles is freed at once as always; garbage in cycles
waits a little longer.

The allocator (:func:`reuse_freed_memory`, setting ``REUSE_FREED_MEMORY``). glibc serves
allocations above a threshold (128 KiB at first) with fresh ``mmap`` mappings and
returns freed memory at the top of the heap to the kernel, so a consumer of 100 KiB–MiB
records faults in fresh pages for every fetch buffer and every copy of a record. With
large allocations served from the heap and freed memory kept for reuse, those faults
disappear; the price is that resident memory stays at its peak instead of shrinking
after a burst, a peak the service's fetch sizes bound.

What each setting saved, measured, is in ``docs/performance.md``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)

#: allocations between collections of the youngest generation (CPython's default: 700)
YOUNG_THRESHOLD = 20_000

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc's largest allowed mmap threshold on 64-bit systems
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 256 * 1024 * 1024


def collect_less() -> int:
    """Freeze what exists now and collect the youngest generation less often; the
    number of objects frozen."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
    return gc.get_freeze_count()


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
