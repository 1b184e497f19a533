"""A batch of records in, the outputs to send and the offsets safe to commit out.

::

    records ─▶ measuring (thread or process): decode → verify → contract → metrics → detector
            ─▶ this module, in its own thread: exporter, join with outcomes, outputs

:meth:`Pipeline.process` is the one entry point: it hands a batch's trace records to the
measuring worker at once and returns a future of the :class:`Batch`, accounted for in
the pipeline's own thread (so the caller can poll the next batch meanwhile). Batches are
accounted for in the order they were given. Nothing here knows Kafka: the service sends
the outputs, then commits what the batch allows; the demo feeds the same pipeline
in-process.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from monitor.core.detect import Verdict
from monitor.core.join import JoinBuffer, Joined
from monitor.core.key_state import KeyState
from monitor.core.metrics import HeadMetrics
from monitor.errors import RejectReason, TraceRejected
from monitor.measuring.measurer import Duplicate, Measured, Rejected, Result
from monitor.measuring.workers import Measuring, results
from monitor.protocol import judge_state, observations
from monitor.protocol.dead_letter import dead_letter, encode_dead_letter
from monitor.protocol.observations import Forwarded
from monitor.protocol.records import Output, Record, Source, TraceIdentity
from monitor.protocol.schema import TaskOutcome
from monitor.protocol.topics import Topics
from monitor.service.exporter import LayerSeries, MonitorMetrics
from monitor.service.findings import Findings, Found, Mode

__all__ = ["Batch", "Pipeline"]

log = logging.getLogger(__name__)
TP = tuple[str, int]


@dataclass(frozen=True)
class Batch:
    """What one batch of records leaves to do."""

    outputs: list[Output]
    positions: dict[TP, int]  #: next offset to read of every partition, after this batch
    committable: dict[TP, int]  #: safe to commit with the outputs
    taught: bool = False  #: a trace of the batch taught a reference (save the state before committing)

    @staticmethod
    def merged(batches: list[Batch]) -> Batch:
        """Consecutive batches as one (each carries the offsets of every batch before it,
        so the last one's positions and committable offsets are theirs)."""
        if len(batches) == 1:
            return batches[0]
        return Batch([o for b in batches for o in b.outputs], batches[-1].positions, batches[-1].committable,
                     any(b.taught for b in batches))


@dataclass
class _Waiting:
    """What a measured trace leaves in the join buffer (never its weights)."""

    trace: TraceIdentity
    series: LayerSeries
    found: Found | None = None  #: what judging it here found (JUDGING=instance), its records written when joined
    #: what its judge needs (JUDGING=fleet: forwarded once its outcome is known)
    heads: tuple[str, ...] = ()
    metrics: HeadMetrics | None = None


@dataclass(frozen=True)
class _Judging:
    """A batch's observation records (JUDGING=fleet): each one's entries, or why it
    could not be read, and the judge's verdicts on all the entries, in order."""

    entries: dict[Source, list[Forwarded] | TraceRejected]
    verdicts: Future[list[Verdict | Duplicate | Rejected]] | None
    #: a round of the judges' state after this batch: their states, and per owned
    #: observations partition the offset the round has taken in and the keys on it
    states: Future[list[KeyState]] | None = None
    rounds: dict[int, tuple[int, list[tuple[str, str]]]] = field(default_factory=dict)


class Pipeline:
    def __init__(
        self,
        measuring: Measuring,
        *,
        metrics: MonitorMetrics,
        topics: Topics | None = None,
        join_ttl: float = 30.0,
        join_max_entries: int = 200_000,
        incident_quiet: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        judging: str = "instance",
        judged_by: Callable[[str, str], str] = lambda model, revision: revision,
        state_interval: float = 30.0,
    ):
        """``judging`` is ``JUDGING``: with ``fleet``, measured traces leave, joined to their
        outcome, for the observations topic keyed by their stream's judge
        (``judged_by(model, revision)``: the revision whose reference judges it), and the
        observation records this instance is given are judged here."""
        self.fleet = judging == "fleet"
        self.judged_by = judged_by
        self._forward: dict[bytes, list[Forwarded]] = {}  #: this batch's traces for their judges, by key
        #: the owned observations partitions: the next offset after the batches queued, the
        #: judge keys seen on each; a round of their state every ``state_interval`` seconds
        self._queued: dict[int, int] = {}
        self._keys_on: dict[int, set[tuple[str, str]]] = {}
        self._state_interval, self._round_at = state_interval, -math.inf
        self.measuring = measuring
        self.metrics = metrics
        self.topics = topics or Topics()
        self.join: JoinBuffer[_Waiting] = JoinBuffer(join_ttl, join_max_entries)
        self.findings = Findings(metrics, self.topics, incident_quiet, clock, wall_clock)
        self.incidents = self.findings.incidents
        self._emitted: set[Source] = set()
        self._emitted_lock = threading.Lock()
        #: the join's watermark: the newest event time read on each stream, and when
        self._newest = {"trace": -math.inf, "outcome": -math.inf}
        self._read_at = {"trace": -math.inf, "outcome": -math.inf}
        #: next offset to read of each partition, after the batches accounted for so far
        self._progress: dict[TP, int] = {}
        self._clock, self._wall = clock, wall_clock
        self._evicted = dict(self.join.evictions)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="pipeline")

    def process(self, records: list[Record]) -> Future[Batch]:
        """Measure and account for a batch; an empty batch only lets traces whose outcome
        did not come within the TTL leave with ``missing``."""
        measuring = self.measuring.submit([r for r in records if r.topic == self.topics.traces])
        judging = self._judging([r for r in records if r.topic == self.topics.observations]) if self.fleet else None
        if judging is not None and self._queued and self._clock() - self._round_at >= self._state_interval:
            self._round_at = self._clock()
            keys = sorted({k for p in self._queued for k in self._keys_on.get(p, ())})
            judging = dataclasses.replace(judging, states=self.measuring.key_states(keys), rounds={
                p: (offset, sorted(self._keys_on.get(p, ()))) for p, offset in self._queued.items()})
        return self._worker.submit(self._account, records, measuring, judging)

    def _judging(self, records: list[Record]) -> _Judging:
        """Read a batch's observation records and queue their entries for the judge (in
        order with the traces measured before and after them)."""
        entries: dict[Source, list[Forwarded] | TraceRejected] = {}
        queued: list[Forwarded] = []
        for record in records:
            self._queued[record.partition] = record.offset + 1
            try:
                key, read = observations.read(record.key, record.value)
                self._keys_on.setdefault(record.partition, set()).add(key)
            except TraceRejected as exc:
                entries[(record.topic, record.partition, record.offset)] = exc
                continue
            entries[(record.topic, record.partition, record.offset)] = read
            queued += read
        return _Judging(entries, self.measuring.judge_forwarded(queued) if queued else None)

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    # --- the pipeline's own thread (or, for the methods below, while it is idle) --------

    def _account(self, records: list[Record], measuring: list[Future[list[Result]]],
                 judging: _Judging | None) -> Batch:
        measured = results(measuring)
        verdicts = iter(judging.verdicts.result() if judging is not None and judging.verdicts is not None else [])
        outputs = []
        taught = False
        for record in records:
            if record.topic == self.topics.traces:
                result = next(measured)
                taught |= isinstance(result, Measured) and result.verdict.learning
                outputs += self._trace(record, result)
            elif judging is not None and record.topic == self.topics.observations:
                entries = judging.entries[(record.topic, record.partition, record.offset)]
                if isinstance(entries, TraceRejected):
                    outputs += self._reject(record, entries.reason, entries.detail, None)
                else:
                    judged = [(entry, next(verdicts)) for entry in entries]
                    taught |= any(isinstance(v, Verdict) and v.learning for _, v in judged)
                    outputs += self._judged(record, judged)
            else:
                outputs += self._outcome(record)
            self._progress[(record.topic, record.partition)] = record.offset + 1
        outputs += self._emit(self.join.expire(self._watermark()))
        outputs += self.findings.expire()
        outputs += self._forwarded()
        if judging is not None and judging.states is not None:
            outputs += self._state_round(judging)
        return Batch(outputs, dict(self._progress), self._committable(), taught)

    def _state_round(self, judging: _Judging) -> list[Output]:
        """A round of the judges' state for each owned observations partition, to the same
        partition of the judge-state topic (``monitor.protocol.judge_state``)."""
        assert judging.states is not None
        states = {s.key: s for s in judging.states.result()}
        out = []
        for partition, (offset, keys) in sorted(judging.rounds.items()):
            source = (self.topics.observations, partition, offset)
            judged = set(keys)
            revisions = [k for k in self.incidents.open if (k[0], self.judged_by(*k)) in judged]
            records = judge_state.encode_round([states[k] for k in keys if k in states], offset,
                                               self.incidents.state(revisions, self._clock()))
            out += [Output(self.topics.judge_state, key, value, source, partition) for key, value in records]
        return out

    def replayed(self, judged: list[tuple[Forwarded, Verdict | Duplicate | Rejected]],
                 incidents: list[dict[str, Any]]) -> None:
        """An observations partition moved here (with no batch in flight): the open
        incidents of its latest round, then what its traces judged again since found,
        taken into them silently (their records were written when first judged), so a
        fault that goes on keeps its incident and pages no more."""
        self.findings.restore(incidents)
        for entry, verdict in judged:
            self.findings.judged(entry.identity, verdict, entry.outcome, entry.identity.source, Mode.REPLAYED)
        self.findings.export_open()

    def restored(self, partition: int, keys: Iterable[tuple[str, str]], committed: int) -> None:
        """An observations partition moved here, its judge keys' state installed as of
        ``committed`` (with no batch in flight)."""
        self._keys_on.setdefault(partition, set()).update(keys)
        self._queued[partition] = committed

    def _event_time(self, record: Record, stream: str) -> float:
        """The record's time (never later than now: a producer's clock may run ahead),
        and the watermark's bookkeeping."""
        at = min(record.timestamp, self._wall()) if record.timestamp > 0 else self._wall()
        self._newest[stream] = max(self._newest[stream], at)
        self._read_at[stream] = self._clock()
        return at

    def _watermark(self) -> float:
        """The join's clock: the older of the newest trace and the newest outcome read, so
        a stream read ahead of the other (small outcomes racing large traces through a
        backlog) expires nothing; a stream quiet for a TTL no longer holds it back, and
        when both are, everything waiting may go."""
        now = self._clock()
        active = [self._newest[s] for s in self._newest if now - self._read_at[s] < self.join.ttl]
        return min(active) if active else math.inf

    def _trace(self, record: Record, result: Result) -> list[Output]:
        self.metrics.consumed.inc()
        if isinstance(result, Rejected):
            return self._reject(record, result.reason, result.detail, result.header)
        if isinstance(result, Duplicate):
            self.metrics.duplicates.inc()
            return []
        return self._measured(record, result)

    def _measured(self, record: Record, result: Measured) -> list[Output]:
        ident = result.identity
        series = self.metrics.layer(ident.model_id, ident.model_revision, ident.layer)
        series.observe_trace(result.heads, result.metrics)
        self.metrics.processing.observe(result.seconds)
        self.metrics.trace_processed(self._wall())
        if self.fleet:  # judged where its stream's observations arrive, once its outcome is known
            waiting = _Waiting(ident, series, heads=result.heads, metrics=result.metrics)
            outputs: list[Output] = []
        else:
            outputs, found = self.findings.judged(ident, result.verdict, None, _source(record))
            waiting = _Waiting(ident, series, found)
        at = self._event_time(record, "trace")
        return outputs + self._emit(self.join.add_trace(ident.request_id, waiting, record.partition, record.offset, at))

    def _outcome(self, record: Record) -> list[Output]:
        self.metrics.outcomes_consumed.inc()
        try:
            outcome = TaskOutcome.model_validate_json(bytes(record.value or b""))
        except ValidationError as exc:
            self.metrics.outcomes_rejected.labels(RejectReason.MALFORMED.value).inc()
            detail = f"outcome: {exc.errors()[0]['msg']}"
            return self._dead_letter(record, RejectReason.MALFORMED, detail, None)
        joined = self.join.add_outcome(outcome.request_id, outcome.outcome, record.partition, record.offset,
                                       self._event_time(record, "outcome"))
        return self._emit(joined)

    def _reject(self, record: Record, reason: RejectReason, detail: str, header: Any) -> list[Output]:
        self.metrics.rejected.labels(reason.value).inc()
        log.warning("rejected %s/%d@%d: %s", record.topic, record.partition, record.offset, reason.value)
        return self._dead_letter(record, reason, detail, header)

    def _dead_letter(self, record: Record, reason: RejectReason, detail: str, header: Any) -> list[Output]:
        source = (record.topic, record.partition, record.offset)
        with self._emitted_lock:
            if source in self._emitted:
                return []
        value = None if record.value is None else bytes(record.value)
        doc = dead_letter(reason, detail, topic=record.topic, partition=record.partition, offset=record.offset,
                          record=value, key=record.key, header=header)
        return [Output(self.topics.dead_letter, record.key, encode_dead_letter(doc), source)]

    def _emit(self, joined: Iterable[Joined[_Waiting]]) -> list[Output]:
        out = []
        for item in joined:
            w = item.item
            if self.fleet:
                w.series.observe_joined(item.outcome)
            else:
                w.series.observe_outcome(item.outcome, (a.kind for a in (w.found.anomalies if w.found else [])))
            source = (self.topics.traces, item.partition, item.offset)
            with self._emitted_lock:
                if source in self._emitted:
                    continue
            if self.fleet:
                assert w.metrics is not None
                key = observations.judge_key(w.trace.model_id, self.judged_by(w.trace.model_id,
                                                                              w.trace.model_revision))
                self._forward.setdefault(key, []).append(Forwarded(w.trace, w.heads, w.metrics, item.outcome))
            elif w.found is not None:
                out += self.findings.records(w.found, item.outcome, source)
        self._sync_join_gauges()
        return out

    def _forwarded(self) -> list[Output]:
        """The batch's joined traces for their judges: one record per judge key, its
        traces in the order they were joined (``monitor.protocol.observations``)."""
        out = [Output(self.topics.observations, key, value, entries[0].identity.source)
               for key, entries in self._forward.items() for value in observations.encode_within(entries)]
        self._forward = {}
        return out

    def _judged(self, record: Record, judged: list[tuple[Forwarded, Verdict | Duplicate | Rejected]]
                ) -> list[Output]:
        """Verdicts on an observation record's traces (JUDGING=fleet), each with the outcome
        it came with; a record whose outputs were written before a restart writes none again."""
        source = _source(record)
        with self._emitted_lock:
            mode = Mode.WRITTEN if source in self._emitted else Mode.FRESH
        return [out for entry, verdict in judged
                for out in self.findings.judged(entry.identity, verdict, entry.outcome, source, mode)[0]]

    def _sync_join_gauges(self) -> None:
        self.metrics.join_entries.set(len(self.join))
        for cause, count in self.join.evictions.items():
            if count > self._evicted[cause]:
                self.metrics.join_evictions.labels(cause).inc(count - self._evicted[cause])
                self._evicted[cause] = count

    def _committable(self) -> dict[TP, int]:
        """Offsets safe to commit: the next offset to read, held back to the oldest
        record still waiting in the join buffer (so a crash loses no wait)."""
        traces, outcomes = self.join.oldest_offsets()
        safe = {}
        for (topic, partition), position in self._progress.items():
            held = traces if topic == self.topics.traces else outcomes if topic == self.topics.outcomes else {}
            waiting = held.get(partition)
            safe[(topic, partition)] = min(position, waiting) if waiting is not None else position
        return safe

    def reassign(self, positions: dict[TP, int], lost: Iterable[int], emitted: set[Source]) -> None:
        """After a rebalance, with no batch in flight: ``positions`` are where the
        assigned partitions resume; waiting state of the trace partitions ``lost`` to
        other instances is dropped, and those traces leave the measurer's
        de-duplication window (should the partitions come back, they are re-read from
        the last commit and must be processed again); ``emitted`` are sources whose
        outputs are already written (found by reading the output topics back)."""
        self._progress = dict(positions)
        self._queued = {p: o for (t, p), o in positions.items() if t == self.topics.observations}
        self._keys_on = {p: keys for p, keys in self._keys_on.items() if p in self._queued}
        dropped = self.join.drop_partitions(lost)
        if dropped:
            log.info("dropped %d waiting traces of revoked partitions", len(dropped))
        self._sync_join_gauges()
        self.measuring.forget([waiting.trace.trace_id for waiting in dropped])
        with self._emitted_lock:
            self._emitted |= emitted

    def committed(self, offsets: dict[TP, int]) -> None:
        """Offsets committed: outputs of records below them are never needed again."""
        if not offsets:
            return
        with self._emitted_lock:
            self._emitted = {s for s in self._emitted if s[2] >= offsets.get((s[0], s[1]), -1)}



def _source(record: Record) -> Source:
    return record.topic, record.partition, record.offset
