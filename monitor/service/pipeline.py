"""A batch of records in, the outputs to send and the offsets safe to commit out.

::

    trace records ─▶ measuring (processes or a thread): decode → verify → contract → metrics
                  ─▶ join with outcomes (service/join.py) ─▶ attention-observations, keyed by judge
                     (no outcome within the join window: pending, and its request waits in
                     service/late.py for one, which follows its traces to the same judge)
    observation records ─▶ the judge (de-duplication, detector) ─▶ findings (service/findings.py)

:meth:`Pipeline.process` is the one entry point: it hands a batch's trace records to the
measuring worker and its observation records to the judge at once, and returns a future
of the :class:`Batch`, accounted for in the pipeline's own thread (so the caller can poll
the next batch meanwhile). Batches are accounted for in the order they were given.
Nothing here knows Kafka: the service sends the outputs, then commits what the batch
allows; in-process users (the demo, tests) hand the observation outputs back in with
:class:`Loopback`, as the broker would.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pydantic import ValidationError

from monitor.core.detect import Verdict
from monitor.core.join import Joined
from monitor.core.outcome import PENDING, Outcome
from monitor.errors import RejectReason, TraceRejected
from monitor.measuring.measurer import Duplicate, Measured, Rejected, Result
from monitor.measuring.workers import Measuring, results
from monitor.protocol.dead_letter import dead_letter, encode_dead_letter
from monitor.protocol.observations import LateOutcome, parse_key
from monitor.protocol.records import Output, Record, Source
from monitor.protocol.schema import TaskOutcome
from monitor.protocol.topics import OUTCOME_WINDOW_S, Topics
from monitor.service.batch import Batch
from monitor.service.exporter import MonitorMetrics
from monitor.service.findings import Findings, Mode
from monitor.service.fleet import Forwarding, Judged, Judges, Judging
from monitor.service.join import Join, Waiting
from monitor.service.late import Late

__all__ = ["Loopback", "Pipeline"]

log = logging.getLogger(__name__)
TP = tuple[str, int]


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
        judged_by: Callable[[str, str], str] | None = None,
        state_interval: float = 30.0,
        outcome_window: float = OUTCOME_WINDOW_S,
        outcome_max_requests: int = 250_000,
    ):
        """``judged_by(model, revision)``: the revision whose reference judges a trace, its
        judge's key (the service's routing rule; by default the rule the judge starts
        with, :meth:`MeasurerSpec.pins`); ``state_interval``: how often a round of the
        judges' state is written (``STATE_SAVE_INTERVAL_S``); ``outcome_window`` and
        ``outcome_max_requests``: how long and for how many requests an outcome that
        comes after the join window is still attributed (``OUTCOME_WINDOW_S``,
        ``OUTCOME_MAX_REQUESTS``)."""
        if judged_by is None:
            judged_by = measuring.spec.pins().judge_revision
        self.measuring = measuring
        self.metrics = metrics
        self.topics = topics or Topics()
        self.join = Join(metrics, join_ttl, join_max_entries, clock, wall_clock)
        self.late = Late(metrics, self.topics, outcome_window, outcome_max_requests, clock)
        self.findings = Findings(metrics, self.topics, incident_quiet, clock, wall_clock, outcome_max_requests)
        self.incidents = self.findings.incidents
        self.forwarding = Forwarding(self.topics, judged_by)
        self.judges = Judges(measuring, self.topics, judged_by, state_interval, clock)
        self._emitted: set[Source] = set()  #: sources whose outputs are written already
        self._emitted_lock = threading.Lock()
        #: next offset to read of each partition, after the batches accounted for so far
        self._progress: dict[TP, int] = {}
        self._clock, self._wall = clock, wall_clock
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="pipeline")

    def process(self, records: list[Record]) -> Future[Batch]:
        """Measure, judge and account for a batch; an empty batch only lets traces whose
        outcome did not come within the TTL leave with ``missing``."""
        measuring = self.measuring.submit([r for r in records if r.topic == self.topics.traces])
        judging = self.judges.take([r for r in records if r.topic == self.topics.observations])
        return self._worker.submit(self._account, records, measuring, judging)

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    # --- the pipeline's own thread (or, for the methods below, while it is idle) --------

    def _account(self, records: list[Record], measuring: list[Future[list[Result]]], judging: Judging) -> Batch:
        measured = results(measuring)
        verdicts = iter(judging.verdicts.result() if judging.verdicts is not None else [])
        outputs = []
        taught = False
        for record in records:
            if record.topic == self.topics.traces:
                outputs += self._trace(record, next(measured))
            elif record.topic == self.topics.observations:
                entries = judging.entries[_source(record)]
                if isinstance(entries, TraceRejected):
                    outputs += self._reject(record, entries.reason, entries.detail, None)
                else:
                    judged = [(entry, next(verdicts)) for entry in entries]
                    taught |= any(isinstance(v, Verdict) and v.learning for _, v in judged)
                    outputs += self._judged(record, judged, judging.late.get(_source(record), []))
            else:
                outputs += self._outcome(record)
            self._progress[(record.topic, record.partition)] = record.offset + 1
        self._forward(self.join.expire())
        written, missing = self.late.outputs(self.join.newest())
        for judged_by, late in missing:
            self.forwarding.add_late(judged_by, late)
        outputs += self.findings.expire()
        outputs += self.forwarding.records()
        outputs += written
        outputs += self.judges.round(judging, self.incidents, self._clock())
        held = self.join.held(self.topics.traces, self.topics.outcomes, self._progress)
        return Batch(outputs, dict(self._progress), self.late.held(self.topics.traces, held), taught)

    def replayed(self, judged: Judged, incidents: list[dict[str, Any]]) -> None:
        """An observations partition moved here (with no batch in flight): the open
        incidents of its latest round, then what its traces judged again since found,
        taken into them silently (their records were written when first judged), so a
        fault that goes on keeps its incident and pages no more."""
        self.findings.restore(incidents)
        for entry, verdict in judged:
            self.findings.judged(entry.identity, verdict, entry.outcome, entry.identity.source, Mode.REPLAYED)
        self.findings.export_open()

    def _trace(self, record: Record, result: Result) -> list[Output]:
        self.metrics.consumed.inc()
        if isinstance(result, Rejected):
            return self._reject(record, result.reason, result.detail, result.header)
        if isinstance(result, Duplicate):
            self.metrics.duplicates.inc()
            return []
        return self._measured(record, result)

    def _measured(self, record: Record, result: Measured) -> list[Output]:
        """A measured trace waits for its outcome; judged where its stream's observations arrive."""
        ident = result.identity
        series = self.metrics.layer(ident.model_id, ident.model_revision, ident.layer)
        series.observe_trace(result.heads, result.metrics)
        self.metrics.processing.observe(result.seconds)
        self.metrics.trace_processed(self._wall())
        self._forward(self.join.trace(record, Waiting(ident, series, result.heads, result.metrics)))
        return []

    def _outcome(self, record: Record) -> list[Output]:
        self.metrics.outcomes_consumed.inc()
        try:
            outcome = TaskOutcome.model_validate_json(bytes(record.value or b""))
        except ValidationError as exc:
            self.metrics.outcomes_rejected.labels(RejectReason.MALFORMED.value).inc()
            detail = f"outcome: {exc.errors()[0]['msg']}"
            return self._dead_letter(record, RejectReason.MALFORMED, detail, None)
        given = Outcome(outcome.outcome, outcome.label, outcome.score, self.join.event_time(record))
        settled = self.late.settle(outcome.request_id, given, _source(record))
        if settled is not None:
            with self._emitted_lock:
                written = _source(record) in self._emitted
            if not written:
                self.forwarding.add_late(*settled)
        self._forward(self.join.outcome(record, outcome.request_id, given, met=settled is not None))
        return []

    def _forward(self, joined: Iterable[Joined[Waiting]]) -> None:
        """Joined traces leave for their judges, but those forwarded before a restart; a
        trace that leaves ``pending`` has its request wait for its outcome (service/late.py)."""
        for item in joined:
            with self._emitted_lock:
                if (self.topics.traces, item.partition, item.offset) in self._emitted:
                    continue
            if item.outcome is PENDING:
                trace = item.item.trace
                at = min(trace.trace_timestamp, self._wall()) if trace.trace_timestamp > 0 else self._wall()
                for judged_by, late in self.late.pending(trace, self.forwarding.judge_of(trace), item.partition,
                                                         item.offset, at):
                    self.forwarding.add_late(judged_by, late)
            self.forwarding.add(item.item, item.outcome)

    def _judged(self, record: Record, judged: Judged, late: list[LateOutcome]) -> list[Output]:
        """Verdicts on an observation record's traces, each with the outcome it came with,
        then its late outcomes; a record whose outputs were written before a restart
        writes none again."""
        source = _source(record)
        with self._emitted_lock:
            mode = Mode.WRITTEN if source in self._emitted else Mode.FRESH
        _, judged_by = parse_key(record.key)
        return [*(out for entry, verdict in judged
                  for out in self.findings.judged(entry.identity, verdict, entry.outcome, source, mode)),
                *(out for item in late for out in self.findings.late(item, judged_by, source, mode))]

    def _reject(self, record: Record, reason: RejectReason, detail: str, header: Any) -> list[Output]:
        self.metrics.rejected.labels(reason.value).inc()
        log.warning("rejected %s/%d@%d: %s", record.topic, record.partition, record.offset, reason.value)
        return self._dead_letter(record, reason, detail, header)

    def _dead_letter(self, record: Record, reason: RejectReason, detail: str, header: Any) -> list[Output]:
        source = _source(record)
        with self._emitted_lock:
            if source in self._emitted:
                return []
        value = None if record.value is None else bytes(record.value)
        doc = dead_letter(reason, detail, topic=record.topic, partition=record.partition, offset=record.offset,
                          record=value, key=record.key, header=header)
        return [Output(self.topics.dead_letter, record.key, encode_dead_letter(doc), source)]

    def reassign(self, positions: dict[TP, int], lost: set[TP], emitted: set[Source]) -> None:
        """After a rebalance, with no batch in flight: ``positions`` are where the
        assigned partitions resume; of the partitions ``lost`` to other instances, the
        trace partitions' waiting state is dropped and their traces leave the measurer's
        de-duplication window (should the partitions come back, they are re-read from
        the last commit and must be processed again), and the observations partitions'
        judge keys hand their open incidents over (:meth:`Findings.hand_over`);
        ``emitted`` are sources whose outputs are already written (found by reading the
        output topics back)."""
        self._progress = dict(positions)
        gone = self.judges.reassign(positions, {p for t, p in lost if t == self.topics.observations})
        self.findings.hand_over(gone, self.judges.judged_by)
        traces = {p for t, p in lost if t == self.topics.traces}
        self.late.drop_partitions(traces)
        dropped = self.join.drop_partitions(traces)
        self.measuring.forget([waiting.trace.trace_id for waiting in dropped])
        with self._emitted_lock:
            self._emitted |= emitted

    def committed(self, offsets: dict[TP, int]) -> None:
        """Offsets committed: outputs of records below them are never needed again."""
        if not offsets:
            return
        with self._emitted_lock:
            self._emitted = {s for s in self._emitted if s[2] >= offsets.get((s[0], s[1]), -1)}


class Loopback:
    """The internal topics without a broker, for in-process users (the demo, tests): a
    batch's observation records come back as records of the observations topic, as a
    consumer of that topic would read them (one partition, offsets in order); rounds of
    the judges' state and the pending outcomes' go nowhere (nothing takes a partition
    over in-process)."""

    def __init__(self, topics: Topics):
        self.topics = topics
        self.pending: list[Record] = []
        self._offset = 0

    def take(self, outputs: list[Output]) -> list[Output]:
        """Keep the observation records of ``outputs`` for the next batch; the others but
        the judges' state and the pending outcomes'."""
        rest = []
        for out in outputs:
            if out.topic in (self.topics.judge_state, self.topics.pending):
                continue
            if out.topic != self.topics.observations:
                rest.append(out)
                continue
            self.pending.append(Record(out.topic, 0, self._offset, out.key, out.value))
            self._offset += 1
        return rest

    def run(self, pipeline: Pipeline, records: list[Record]) -> list[Output]:
        """One batch through ``pipeline`` with the observations of the batches before it,
        then the judging of this batch's own: the outputs but the observation records."""
        batch, self.pending = [*self.pending, *records], []
        outputs = self.take(pipeline.process(batch).result().outputs)
        while self.pending:
            batch, self.pending = self.pending, []
            outputs += self.take(pipeline.process(batch).result().outputs)
        return outputs


def _source(record: Record) -> Source:
    return record.topic, record.partition, record.offset
