"""Outcomes that come after the join window, attributed without holding a commit past it
(``docs/delivery.md``, "Late outcomes").

A trace whose join window closes without its outcome goes on to its judge ``pending``,
and its request enters the pending table (:class:`~monitor.core.pending.PendingOutcomes`,
``OUTCOME_WINDOW_S``, ``OUTCOME_MAX_REQUESTS``). An outcome given by the end of the
request's window settles it: its layers count the outcome (``attention_trace_outcomes_total``)
and a :class:`~monitor.protocol.observations.LateOutcome` goes to the request's judge; a
request whose window closes counts ``missing`` and goes to its judge as such.

The table's changes leave for the same partition of ``attention-pending-outcomes``
(:mod:`monitor.protocol.pending`) every ``FLUSH_S`` seconds, and at once in a batch where
outcomes settle requests, committed with the offsets they follow from; until its request
is written, a trace's partition does not commit past it (at most ``FLUSH_S`` longer than
the join held it). A new owner of a trace partition rebuilds its requests from there
(:meth:`Late.rebuild`). Windows are closed only when the changes are written, so that a
rebuild knows which requests left that way without a record each.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable

from monitor.core.outcome import MISSING, Outcome
from monitor.core.pending import Pending, PendingOutcomes
from monitor.errors import TraceRejected
from monitor.protocol import pending
from monitor.protocol.observations import LateOutcome
from monitor.protocol.records import NO_SOURCE, Output, Source, TraceIdentity
from monitor.protocol.topics import Topics
from monitor.service.exporter import MonitorMetrics

__all__ = ["FLUSH_S", "Late"]

log = logging.getLogger(__name__)
#: how often the pending table's changes are written (a trace's commit waits at most this
#: much longer than the join held it)
FLUSH_S = 5.0
ToJudge = list[tuple[str, LateOutcome]]  #: late outcomes (or missing ones), each with its judge


class Late:
    def __init__(self, metrics: MonitorMetrics, topics: Topics, window: float, max_requests: int,
                 clock: Callable[[], float]):
        self.metrics, self.topics = metrics, topics
        self.table = PendingOutcomes(window, max_requests)
        self._evicted = dict(self.table.evictions)
        self._clock = clock  #: monotonic, for FLUSH_S
        self._event_time = -math.inf  #: the newest event time read: the windows' clock
        self._flushed_at = clock()
        self._urgent = False  #: a request settled or pushed out: write the changes with this batch
        #: per trace partition, the oldest offset of a trace whose request is not written yet
        self._hold: dict[int, int] = {}

    def pending(self, trace: TraceIdentity, judged_by: str, partition: int, offset: int, at: float) -> ToJudge:
        """A trace left the join without its outcome (``at``: its event time): its request
        waits here. Returns the requests pushed out to make room (``missing``)."""
        waiting = self.table.get(trace.request_id)
        before = () if waiting is None else waiting.layers
        pushed = self.table.add(trace.request_id, trace.model_id, trace.model_revision, judged_by, trace.layer,
                                partition, at)
        if trace.layer not in before:
            self.metrics.layer(trace.model_id, trace.model_revision, trace.layer).pending.inc()
        self._hold[partition] = min(self._hold.get(partition, offset), offset)
        self._urgent |= bool(pushed)
        return [(e.judged_by, late) for e, late in zip(pushed, self._left(pushed, MISSING, NO_SOURCE), strict=True)]

    def settle(self, request_id: str, outcome: Outcome, source: Source) -> tuple[str, LateOutcome] | None:
        """An outcome given at ``outcome.at`` and read from ``source``: if its request waits
        here and its window was still open then, it settles it; returns the request's
        judge with what goes to it."""
        entry = self.table.get(request_id)
        if entry is None or entry.deadline < outcome.at:
            return None  # not traced, counted already, or too late (its window closes at the next write)
        self.table.settle(request_id)
        self.metrics.outcomes_late.inc()
        self._urgent = True
        (found,) = self._left([entry], outcome, source)
        return entry.judged_by, found

    def outputs(self, now: float) -> tuple[list[Output], ToJudge]:
        """When due (every ``FLUSH_S``, or a request settled): the requests whose window
        closed by the newest event time read (``now``: ``missing``, each with its judge),
        and the table's changes for the pending-outcomes topic, one record per trace
        partition changed (more when large), to that partition."""
        self._event_time = max(self._event_time, now)
        if not self._urgent and self._clock() - self._flushed_at < FLUSH_S:
            return [], []
        self._flushed_at, self._urgent = self._clock(), False
        gone = self.table.expire(self._event_time)
        missing = [(e.judged_by, late) for e, late in zip(gone, self._left(gone, MISSING, NO_SOURCE), strict=True)]
        deltas = self.table.take_deltas(self._event_time)
        self._hold.clear()
        self._sync()
        return [Output(self.topics.pending, str(partition).encode(), value, (self.topics.pending, partition, -1),
                       partition)
                for partition, delta in sorted(deltas.items()) for value in pending.encode(delta)], missing

    def due(self) -> None:
        """Write the changes with the next batch (before a stop: its commit then holds
        nothing back for them)."""
        self._urgent = True

    def held(self, traces_topic: str, committable: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
        """``committable``, held back on each trace partition to the oldest trace whose
        request is not written yet."""
        return {tp: min(offset, self._hold.get(tp[1], offset)) if tp[0] == traces_topic else offset
                for tp, offset in committable.items()}

    def rebuild(self, partition: int, values: Iterable[bytes | None]) -> int:
        """A trace partition moved here (with no batch in flight): its requests from the
        pending-outcomes records written for it, in order. Returns how many wait."""
        before = {e.request_id for e in self._requests_of(partition)}
        through = -math.inf
        for value in values:
            try:
                delta = pending.decode(value, partition)
            except TraceRejected as exc:
                log.error("pending outcomes of trace partition %d: a record is unreadable (%s); the late outcomes "
                          "of its requests count as unmatched", partition, exc.detail)
                continue
            self.table.apply(delta)
            through = max(through, delta.through)
        self.table.forget(through)
        mine = self._requests_of(partition)
        added = Counter((e.model_id, e.revision, layer) for e in mine if e.request_id not in before
                        for layer in e.layers)
        for (model, revision, layer), count in added.items():
            self.metrics.layer(model, revision, layer).pending.inc(count)
        self._sync()
        return len(mine)

    def drop_partitions(self, partitions: Iterable[int]) -> None:
        """Forget the requests of trace partitions lost to other instances."""
        lost = set(partitions)
        for entry in self.table.drop_partitions(lost):
            for layer in entry.layers:
                self.metrics.layer(entry.model_id, entry.revision, layer).pending.dec()
        self._hold = {p: o for p, o in self._hold.items() if p not in lost}
        self._sync()

    def _requests_of(self, partition: int) -> list[Pending]:
        return [e for e in self.table.requests() if e.partition == partition]

    def _left(self, entries: list[Pending], outcome: Outcome, source: Source) -> list[LateOutcome]:
        """Requests that left the table: their layers count the outcome, no longer pending."""
        out = []
        for entry in entries:
            for layer in entry.layers:
                series = self.metrics.layer(entry.model_id, entry.revision, layer)
                series.pending.dec()
                series.observe_joined(outcome.result)
            out.append(LateOutcome(entry.request_id, entry.model_id, entry.revision, entry.layers, outcome, entry.at,
                                   source))
        return out

    def _sync(self) -> None:
        """The table's size and eviction counters on /metrics."""
        for cause, count in self.table.evictions.items():
            if count > self._evicted[cause]:
                self.metrics.pending_evictions.labels(cause).inc(count - self._evicted[cause])
                self._evicted[cause] = count
        self.metrics.pending_requests.set(len(self.table))
