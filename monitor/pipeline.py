"""decode → verify → contract check → metrics → detector → join, on plain records.

Nothing here knows Kafka: the service hands in :class:`Record` values and sends the
:class:`Output` values it gets back, then commits what :meth:`Pipeline.committable`
allows. The demo feeds the same pipeline in-process.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from monitor.access import Keyring, ScopePolicy
from monitor.codec import Limits, Trace, check_mass, decode
from monitor.contract import TaskOutcome
from monitor.core._blocks import Scratch
from monitor.core.detect import Anomaly, Detector, Observation
from monitor.core.join import JoinBuffer, Joined, RecentKeys
from monitor.core.metrics import head_metrics
from monitor.core.policy import policy_fields
from monitor.deadletter import dead_letter, encode_dead_letter
from monitor.errors import RejectReason, TraceRejected
from monitor.exporter import MonitorMetrics
from monitor.model_contract import ContractTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topics:
    traces: str = "attention-traces"
    outcomes: str = "task-outcomes"
    contracts: str = "attention-contracts"
    anomalies: str = "attention-anomalies"
    dead_letter: str = "attention-dead-letter"


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


@dataclass(frozen=True)
class Output:
    topic: str
    key: bytes | None
    value: bytes
    source: tuple[str, int, int]  #: topic, partition, offset of the record it came from


@dataclass
class _Waiting:
    """What a processed trace leaves in the join buffer (never its weights)."""

    trace: dict[str, Any]
    labels: tuple[str, str]
    layer: int
    anomalies: list[Anomaly] = field(default_factory=list)


class Pipeline:
    def __init__(
        self,
        *,
        keyring: Keyring,
        scopes: ScopePolicy,
        contracts: ContractTable,
        detector: Detector,
        metrics: MonitorMetrics,
        limits: Limits | None = None,
        topics: Topics | None = None,
        join_ttl: float = 30.0,
        join_max_entries: int = 200_000,
        dedupe_window: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.keyring, self.scopes, self.contracts = keyring, scopes, contracts
        self.detector, self.metrics = detector, metrics
        self.limits = limits or Limits()
        self.topics = topics or Topics()
        self.join: JoinBuffer[_Waiting] = JoinBuffer(join_ttl, join_max_entries)
        self.recent = RecentKeys(dedupe_window)
        self.already_emitted: set[tuple[str, int, int]] = set()
        self._clock, self._wall = clock, wall_clock
        self._scratch = Scratch()
        self._evicted = dict(self.join.evictions)
        self._declared: set[tuple[tuple[str, str], int]] = set()

    # --- records ------------------------------------------------------------------

    def process(self, record: Record) -> list[Output]:
        if record.topic == self.topics.outcomes:
            return self._outcome(record)
        return self._trace(record)

    def _trace(self, record: Record) -> list[Output]:
        self.metrics.consumed.inc()
        started = time.perf_counter()
        try:
            trace = decode(record.value or b"", keyring=self.keyring, scopes=self.scopes,
                           contracts=self.contracts.get, limits=self.limits, check_mass=False)
        except TraceRejected as exc:
            return self._reject(record, exc.reason, exc.detail, exc.header)
        except Exception as exc:
            log.exception("decode failed unexpectedly at %s/%d@%d", record.topic, record.partition, record.offset)
            return self._reject(record, RejectReason.MALFORMED, f"internal error: {type(exc).__name__}", None)
        if not self.recent.add(("trace", trace.header.trace_id)):
            self.metrics.duplicates.inc()
            return []
        try:
            return self._measure(record, trace, started)
        except TraceRejected as exc:
            return self._reject(record, exc.reason, exc.detail, exc.header)
        except Exception as exc:  # a verified record must not stop the partition either
            log.exception("measuring failed unexpectedly at %s/%d@%d", record.topic, record.partition, record.offset)
            return self._reject(record, RejectReason.MALFORMED, f"internal error: {type(exc).__name__}", trace.header)

    def _measure(self, record: Record, trace: Trace, started: float) -> list[Output]:
        h = trace.header
        m = head_metrics(trace.weights, trace.valid, scratch=self._scratch, with_mass=True)
        assert m.row_mass is not None and m.hidden_mass is not None
        check_mass(trace, m.row_mass, m.hidden_mass, self.limits)  # decode's last checks, on this pass's sums
        labels = self.metrics.model_labels(h.model_id, h.model_revision)
        if (labels, h.layer) not in self._declared:
            self.metrics.declare(labels, h.layer)
            self._declared.add((labels, h.layer))
        self.metrics.observe_trace(labels, h.layer, h.heads, m.entropy.tolist(), m.concentration.tolist(),
                                   m.sink_share.tolist(), float(m.diversity), float(m.effective_heads))
        anomalies = self.detector.observe(Observation(
            h.model_id, h.model_revision, h.layer, h.key_count, h.heads, m.entropy, m.concentration,
            m.sink_share, m.similarity, float(m.diversity)))
        for anomaly in anomalies:
            self.metrics.observe_anomaly(labels, h.layer, anomaly.kind)
        self.metrics.processing.observe(time.perf_counter() - started)
        self.metrics.last_trace.set(self._wall())
        waiting = _Waiting(_trace_identity(trace, record), labels, h.layer, anomalies)
        joined = self.join.add_trace(h.request_id, waiting, record.partition, record.offset, self._clock())
        return self._emit(joined)

    def _outcome(self, record: Record) -> list[Output]:
        self.metrics.outcomes_consumed.inc()
        try:
            outcome = TaskOutcome.model_validate_json(record.value or b"")
        except ValidationError as exc:
            self.metrics.outcomes_rejected.labels(RejectReason.MALFORMED.value).inc()
            detail = f"outcome: {exc.errors()[0]['msg']}"
            return self._dead_letter(record, RejectReason.MALFORMED, detail, None)
        joined = self.join.add_outcome(outcome.request_id, outcome.outcome, record.partition, record.offset,
                                       self._clock())
        return self._emit(joined)

    def expire(self) -> list[Output]:
        """Traces whose outcome did not come within the TTL leave with ``missing``."""
        return self._emit(self.join.expire(self._clock()))

    def _reject(self, record: Record, reason: RejectReason, detail: str, header: Any) -> list[Output]:
        self.metrics.rejected.labels(reason.value).inc()
        log.warning("rejected %s/%d@%d: %s", record.topic, record.partition, record.offset, reason.value)
        return self._dead_letter(record, reason, detail, header)

    def _dead_letter(self, record: Record, reason: RejectReason, detail: str, header: Any) -> list[Output]:
        source = (record.topic, record.partition, record.offset)
        if source in self.already_emitted:
            return []
        doc = dead_letter(reason, detail, topic=record.topic, partition=record.partition, offset=record.offset,
                          record=record.value, key=record.key, header=header)
        return [Output(self.topics.dead_letter, record.key, encode_dead_letter(doc), source)]

    def _emit(self, joined: Iterable[Joined[_Waiting]]) -> list[Output]:
        out = []
        for item in joined:
            w = item.item
            self.metrics.observe_outcome(w.labels, w.layer, item.outcome, (a.kind for a in w.anomalies))
            source = (self.topics.traces, item.partition, item.offset)
            if source in self.already_emitted:
                continue
            for anomaly in w.anomalies:
                doc = anomaly_record(w.trace, anomaly, item.outcome, self._wall())
                out.append(Output(self.topics.anomalies, w.trace["request_id"].encode(),
                                  json.dumps(doc, sort_keys=True).encode(), source))
        self._sync_join_gauges()
        return out

    def _sync_join_gauges(self) -> None:
        self.metrics.join_entries.set(len(self.join))
        for cause, count in self.join.evictions.items():
            if count > self._evicted[cause]:
                self.metrics.join_evictions.labels(cause).inc(count - self._evicted[cause])
                self._evicted[cause] = count

    # --- delivery -------------------------------------------------------------------

    def committable(self, positions: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
        """Offsets safe to commit: the next offset to read, held back to the oldest
        record still waiting in the join buffer (so a crash loses no wait)."""
        traces, outcomes = self.join.oldest_offsets()
        safe = {}
        for (topic, partition), position in positions.items():
            waiting = (traces if topic == self.topics.traces else outcomes).get(partition)
            safe[(topic, partition)] = min(position, waiting) if waiting is not None else position
        return safe

    def drop_partitions(self, partitions: Iterable[int]) -> None:
        """Forget waiting state of partitions now owned elsewhere. Their traces also
        leave the de-duplication window: should the partitions come back, the traces
        are re-read from the last commit and must be processed again."""
        dropped = self.join.drop_partitions(partitions)
        for waiting in dropped:
            self.recent.discard(("trace", waiting.trace["trace_id"]))
        if dropped:
            log.info("dropped %d waiting traces of revoked partitions", len(dropped))
        self._sync_join_gauges()


def _trace_identity(trace: Trace, record: Record) -> dict[str, Any]:
    h = trace.header
    return {
        "trace_id": h.trace_id, "request_id": h.request_id, "model_id": h.model_id,
        "model_revision": h.model_revision, "contract_id": h.contract_id, "layer": h.layer,
        "key_count": h.key_count, "trace_timestamp": h.timestamp,
        "source": {"topic": record.topic, "partition": record.partition, "offset": record.offset},
    }


def anomaly_record(trace: dict[str, Any], anomaly: Anomaly, outcome: str, now: float) -> dict[str, Any]:
    """The JSON anomaly record: identity, finding, outcome and the two policy sentences."""
    return {
        "schema": "attention-anomaly/1",
        **trace,
        "kind": anomaly.kind,
        "heads": list(anomaly.heads),
        "value": anomaly.value,
        "reference": anomaly.reference,
        "reference_revision": anomaly.reference_revision,
        "effect_size": anomaly.effect,
        "score": anomaly.score,
        "outcome": outcome,
        "detected_at": now,
        "policy": policy_fields(),
    }
