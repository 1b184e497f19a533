"""The service process's garbage collector, set for a process that holds many traces.

CPython collects its youngest generation every 700 allocations, and the whole heap
whenever a quarter of it is new since the last full collection. Each trace waiting for
its outcome in the join buffer is a few objects that live seconds, so they all reach the
oldest generation, and every full collection walks the service's whole heap,
including the tens of thousands of objects it made while starting (modules, functions,
pydantic and Kafka client internals), which never become garbage. On the service bench
(129 KiB traces, one measuring process) a full collection took 69 ms of the results
reader's time, during which the consumer cannot run, and the collector cost about
11 µs a trace.

:func:`collect_less` moves what exists after start out of the collector's reach
(``gc.freeze``) and collects the youngest generation every ``YOUNG_THRESHOLD``
allocations. A/B on the bench, alternating on one broker, 3 pairs: 1,723 / 1,808 /
1,541 traces/s became 1,871 / 2,059 / 2,175, and the CPU a trace fell by 5–22 %.
Garbage without cycles is freed at once as always; garbage in cycles waits a little
longer.
"""

from __future__ import annotations

import gc

#: allocations between collections of the youngest generation (CPython's default: 700)
YOUNG_THRESHOLD = 20_000


def collect_less() -> int:
    """Freeze what exists now and collect the youngest generation less often; the
    number of objects frozen."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
    return gc.get_freeze_count()
