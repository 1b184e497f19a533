"""The join of measured traces with their task outcomes, by request id, on event time.

A measured trace waits here (its identity and metrics, never its weights) until its
outcome arrives or the join's TTL passes on the watermark (then it leaves ``pending``:
its outcome may still come, :mod:`monitor.service.late`); either way it leaves as a
:class:`~monitor.core.join.Joined` for its judge (:mod:`monitor.service.fleet`). The
buffer is bounded (``JOIN_MAX_ENTRIES``), and while a trace or an outcome waits, its
partition's commit is held back to it, so a crash loses no wait. The join's gauges (entries, evictions) are kept here.

A joined trace is handed on once, its outcome with it. An outcome waits in turn until
the TTL for traces of its request still to come, then goes; one that met none, and was
not taken by the pending table either, counts in ``attention_monitor_outcomes_unmatched_total``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from monitor.core.join import JoinBuffer, Joined
from monitor.core.metrics import HeadMetrics
from monitor.core.outcome import PENDING, Outcome
from monitor.protocol.records import Record, TraceIdentity
from monitor.service.exporter import MonitorMetrics
from monitor.service.layer_series import LayerSeries

__all__ = ["Join", "Waiting"]

log = logging.getLogger(__name__)


@dataclass
class Waiting:
    """What a measured trace leaves in the join buffer (never its weights): what its
    judge needs once its outcome is known."""

    trace: TraceIdentity
    series: LayerSeries
    heads: tuple[str, ...]
    metrics: HeadMetrics


class Join:
    def __init__(self, metrics: MonitorMetrics, ttl: float, max_entries: int, clock: Callable[[], float],
                 wall_clock: Callable[[], float]):
        self.metrics = metrics
        self.buffer: JoinBuffer[Waiting] = JoinBuffer(ttl, max_entries, left_without=PENDING)
        self._clock, self._wall = clock, wall_clock
        #: the watermark: the newest event time read on each stream, and when
        self._newest = {"trace": -math.inf, "outcome": -math.inf}
        self._read_at = {"trace": -math.inf, "outcome": -math.inf}
        self._evicted = dict(self.buffer.evictions)
        self._unmatched = 0

    def trace(self, record: Record, waiting: Waiting) -> list[Joined[Waiting]]:
        """A measured trace waits for its outcome (or finds it waiting)."""
        at = self._event_time(record, "trace")
        return self._joined(self.buffer.add_trace(waiting.trace.request_id, waiting, record.partition, record.offset,
                                                  at))

    def outcome(self, record: Record, request_id: str, outcome: Outcome, met: bool = False
                ) -> list[Joined[Waiting]]:
        """An outcome meets its trace (or waits for it; ``met``: it settled a request of
        the pending table already)."""
        at = self._event_time(record, "outcome")
        return self._joined(self.buffer.add_outcome(request_id, outcome, record.partition, record.offset, at, met))

    def event_time(self, record: Record) -> float:
        """The record's time, never later than now."""
        return min(record.timestamp, self._wall()) if record.timestamp > 0 else self._wall()

    def newest(self) -> float:
        """The newest event time read on either stream (the pending table's clock: unlike
        the watermark, never infinite when both are quiet)."""
        return max(self._newest.values())

    def expire(self) -> list[Joined[Waiting]]:
        """Traces whose outcome did not come within the TTL, leaving ``pending``."""
        return self._joined(self.buffer.expire(self._watermark()))

    def held(self, traces_topic: str, outcomes_topic: str, progress: dict[tuple[str, int], int]
             ) -> dict[tuple[str, int], int]:
        """Offsets safe to commit: ``progress`` (the next offset to read), held back to the
        oldest record still waiting on each partition."""
        traces, outcomes = self.buffer.oldest_offsets()
        safe = {}
        for (topic, partition), position in progress.items():
            held = traces if topic == traces_topic else outcomes if topic == outcomes_topic else {}
            waiting = held.get(partition)
            safe[(topic, partition)] = min(position, waiting) if waiting is not None else position
        return safe

    def drop_partitions(self, lost: Iterable[int]) -> list[Waiting]:
        """Forget what waits of the trace partitions ``lost`` to other instances."""
        dropped = self.buffer.drop_partitions(lost)
        if dropped:
            log.info("dropped %d waiting traces of revoked partitions", len(dropped))
        self._sync_gauges()
        return dropped

    def _joined(self, joined: Iterable[Joined[Waiting]]) -> list[Joined[Waiting]]:
        out = list(joined)
        for item in out:
            if item.outcome is not PENDING:  # counted when it comes, or as missing (service/late.py)
                item.item.series.observe_joined(item.outcome.result)
        self._sync_gauges()
        return out

    def _event_time(self, record: Record, stream: str) -> float:
        """The record's time (never later than now: a producer's clock may run ahead),
        and the watermark's bookkeeping."""
        at = self.event_time(record)
        self._newest[stream] = max(self._newest[stream], at)
        self._read_at[stream] = self._clock()
        return at

    def _watermark(self) -> float:
        """The join's clock: the older of the newest trace and the newest outcome read, so
        a stream read ahead of the other (small outcomes racing large traces through a
        backlog) expires nothing; a stream quiet for a TTL no longer holds it back, and
        when both are, everything waiting may go."""
        now = self._clock()
        active = [self._newest[s] for s in self._newest if now - self._read_at[s] < self.buffer.ttl]
        return min(active) if active else math.inf

    def _sync_gauges(self) -> None:
        self.metrics.join_entries.set(len(self.buffer))
        if self.buffer.unmatched > self._unmatched:
            self.metrics.outcomes_unmatched.inc(self.buffer.unmatched - self._unmatched)
            self._unmatched = self.buffer.unmatched
        for cause, count in self.buffer.evictions.items():
            if count > self._evicted[cause]:
                self.metrics.join_evictions.labels(cause).inc(count - self._evicted[cause])
                self._evicted[cause] = count
