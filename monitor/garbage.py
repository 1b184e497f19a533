"""The garbage collector of the service's processes, set for processes that handle many
traces.

CPython collects its youngest generation every 700 allocations, and the whole heap
whenever a quarter of it is new since the last full collection. Each trace waiting for
its outcome in the join buffer is a few objects that live seconds, so they all reach the
oldest generation, and every full collection walks the service's whole heap,
including the tens of thousands of objects it made while starting (modules, functions,
pydantic and Kafka client internals), which never become garbage. On the service bench
(129 KiB traces, one measuring process) a full collection took 69 ms of the results
reader's time, during which the consumer cannot run, and the collector cost 8.5–11 µs
a trace. The measuring process, which holds the de-duplication window, spent
about 12 µs a trace on 270 young collections per 17,000 traces.

:func:`collect_less` moves what exists after start out of the collector's reach
(``gc.freeze``) and collects the youngest generation every ``YOUNG_THRESHOLD``
allocations (of objects it tracks, net of those freed). Timed with ``gc.callbacks`` on
the bench: the service process's collections went from 8.5 to 1.7 µs a trace (173 young,
16 middle and one full collection of 58 ms in 18,600 traces; then 11 young ones in
19,400), and the measuring process's from 12 µs to none in 15,000 traces. A/B on the
bench, alternating on one broker, one measuring process: with the service process's
settings alone, median 2,200 → 2,232 traces/s in 4 pairs (+4, −4, −2, +9 %), within the
noise; with both processes', 2,254 → 2,380 (+13, +3, +3, +5 %; CPU a trace 0.69–0.74 →
0.67–0.72 ms, lower in every pair), and while the VM ran slowly 1,867 → 1,991 (+22, +8,
−3, +10 %). Garbage without cycles is freed at once as always; garbage in cycles waits
a little longer: fed 40,000 fresh traces, the service process levelled off at 174 MiB
(PSS) after 22,000 instead of 170 after 8,000.
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
