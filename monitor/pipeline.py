"""decode → verify → contract check → metrics → detector → join, on plain records.

The first five steps are the trace stage (:mod:`monitor.stage`); this module adds the
join, the exporter's bookkeeping and the outputs. Nothing here knows Kafka: the service
hands in :class:`Record` values (and, for traces, the stage's results from its measuring
process) and sends the :class:`Output` values it gets back, then commits what
:meth:`Pipeline.committable` allows. The demo feeds the same pipeline in-process.
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
from monitor.codec import Limits
from monitor.contract import TaskOutcome
from monitor.core.detect import Anomaly, Detector
from monitor.core.join import JoinBuffer, Joined
from monitor.core.policy import policy_fields
from monitor.deadletter import dead_letter, encode_dead_letter
from monitor.errors import RejectReason
from monitor.exporter import MonitorMetrics
from monitor.model_contract import ContractTable
from monitor.stage import Duplicate, Record, Rejected, Result, TraceStage

__all__ = ["Output", "Pipeline", "Record", "Topics", "anomaly_record"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topics:
    traces: str = "attention-traces"
    outcomes: str = "task-outcomes"
    contracts: str = "attention-contracts"
    anomalies: str = "attention-anomalies"
    dead_letter: str = "attention-dead-letter"


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
        metrics: MonitorMetrics,
        keyring: Keyring | None = None,
        scopes: ScopePolicy | None = None,
        contracts: ContractTable | None = None,
        detector: Detector | None = None,
        remote_stage: bool = False,
        limits: Limits | None = None,
        topics: Topics | None = None,
        join_ttl: float = 30.0,
        join_max_entries: int = 200_000,
        dedupe_window: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        """Traces go through a :class:`TraceStage` built from ``keyring``, ``scopes``,
        ``contracts``, ``detector``, ``limits`` and ``dedupe_window``; with
        ``remote_stage`` there is none here: the caller runs the stage elsewhere and
        hands its results to :meth:`apply`."""
        self.stage: TraceStage | None = None
        if not remote_stage:
            if keyring is None or scopes is None or contracts is None or detector is None:
                raise ValueError("a local stage needs keyring, scopes, contracts and detector")
            self.stage = TraceStage(keyring=keyring, scopes=scopes, contracts=contracts, detector=detector,
                                    limits=limits, dedupe_window=dedupe_window)
        self.metrics = metrics
        self.topics = topics or Topics()
        self.join: JoinBuffer[_Waiting] = JoinBuffer(join_ttl, join_max_entries)
        self.already_emitted: set[tuple[str, int, int]] = set()
        self._clock, self._wall = clock, wall_clock
        self._evicted = dict(self.join.evictions)
        self._declared: set[tuple[tuple[str, str], int]] = set()

    # --- records ------------------------------------------------------------------

    def process(self, record: Record) -> list[Output]:
        if record.topic == self.topics.outcomes:
            return self._outcome(record)
        if self.stage is None:
            raise RuntimeError("this pipeline's trace stage runs elsewhere; hand its results to apply()")
        return self.apply(record, self.stage.run(record))

    def apply(self, record: Record, result: Result) -> list[Output]:
        """Account for a trace record the stage has dealt with (here, or in the
        service's measuring process): metrics, join, and the outputs to send."""
        self.metrics.consumed.inc()
        if isinstance(result, Rejected):
            return self._reject(record, result.reason, result.detail, result.header)
        if isinstance(result, Duplicate):
            self.metrics.duplicates.inc()
            return []
        ident = result.identity
        labels = self.metrics.model_labels(ident["model_id"], ident["model_revision"])
        layer = ident["layer"]
        if (labels, layer) not in self._declared:
            self.metrics.declare(labels, layer)
            self._declared.add((labels, layer))
        self.metrics.observe_trace(labels, layer, result.heads, result.entropy, result.concentration,
                                   result.sink_share, result.diversity, result.effective_heads)
        for anomaly in result.anomalies:
            self.metrics.observe_anomaly(labels, layer, anomaly.kind)
        self.metrics.processing.observe(result.seconds)
        self.metrics.last_trace.set(self._wall())
        waiting = _Waiting(ident, labels, layer, result.anomalies)
        joined = self.join.add_trace(ident["request_id"], waiting, record.partition, record.offset, self._clock())
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

    def drop_partitions(self, partitions: Iterable[int]) -> list[str]:
        """Forget waiting state of partitions now owned elsewhere, and return the trace
        ids dropped. They leave the stage's de-duplication window too (a remote stage
        must be told): should the partitions come back, the traces are re-read from
        the last commit and must be processed again."""
        dropped = self.join.drop_partitions(partitions)
        if dropped:
            log.info("dropped %d waiting traces of revoked partitions", len(dropped))
        self._sync_join_gauges()
        trace_ids = [waiting.trace["trace_id"] for waiting in dropped]
        if self.stage is not None:
            self.stage.forget(trace_ids)
        return trace_ids


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
