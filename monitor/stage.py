"""The trace stage: decode → verify → contract check → metrics → detector, per record.

Everything a trace needs that neither writes outputs nor touches the join buffer or the
exporter lives here, so the service can run it in a separate process while it keeps
consuming (see :mod:`monitor.runner`). Its results are small picklable values: a trace's
identity and metrics, the anomalies it raised, or why it was rejected. Never weights.

The stage owns the de-duplication window (so the detector never sees a trace twice)
and the detector's references.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from monitor.access import Keyring, ScopePolicy
from monitor.codec import Limits, Trace, check_mass, decode
from monitor.core._blocks import Scratch
from monitor.core.detect import Anomaly, Detector, Observation
from monitor.core.join import RecentKeys
from monitor.core.metrics import head_metrics
from monitor.errors import RejectReason, TraceRejected
from monitor.model_contract import ContractTable, ModelContract

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | memoryview | None  #: a memoryview in the measuring process (see monitor.runner)


@dataclass(frozen=True)
class Measured:
    """A trace that passed every check, measured and judged."""

    identity: dict[str, Any]  #: ids, model identity, layer, source (what anomaly records carry)
    heads: tuple[str, ...]
    entropy: list[float]
    concentration: list[float]
    sink_share: list[float]
    diversity: float
    effective_heads: float
    seconds: float  #: time spent decoding, measuring and judging
    anomalies: list[Anomaly] = field(default_factory=list)


@dataclass(frozen=True)
class Rejected:
    reason: RejectReason
    detail: str
    header: Any  #: the verified header, when the signature checked out


@dataclass(frozen=True)
class Duplicate:
    trace_id: str


Result = Measured | Rejected | Duplicate


class TraceStage:
    def __init__(
        self,
        *,
        keyring: Keyring,
        scopes: ScopePolicy,
        contracts: ContractTable,
        detector: Detector,
        limits: Limits | None = None,
        dedupe_window: int = 100_000,
    ):
        self.keyring, self.scopes, self.contracts = keyring, scopes, contracts
        self.detector = detector
        self.limits = limits or Limits()
        self.recent = RecentKeys(dedupe_window)
        self._scratch = Scratch()

    def run(self, record: Record) -> Result:
        """Never raises for anything a producer can send."""
        started = time.perf_counter()
        try:
            trace = decode(record.value or b"", keyring=self.keyring, scopes=self.scopes,
                           contracts=self.contracts.get, limits=self.limits, check_mass=False)
        except TraceRejected as exc:
            return Rejected(exc.reason, exc.detail, exc.header)
        except Exception as exc:
            log.exception("decode failed unexpectedly at %s/%d@%d", record.topic, record.partition, record.offset)
            return Rejected(RejectReason.MALFORMED, f"internal error: {type(exc).__name__}", None)
        if not self.recent.add(("trace", trace.header.trace_id)):
            return Duplicate(trace.header.trace_id)
        try:
            return self._measure(record, trace, started)
        except TraceRejected as exc:
            return Rejected(exc.reason, exc.detail, exc.header)
        except Exception as exc:  # a verified record must not stop the partition either
            log.exception("measuring failed unexpectedly at %s/%d@%d", record.topic, record.partition, record.offset)
            return Rejected(RejectReason.MALFORMED, f"internal error: {type(exc).__name__}", trace.header)

    def run_many(self, records: list[Record]) -> list[Result]:
        return [self.run(r) for r in records]

    def forget(self, trace_ids: list[str]) -> None:
        """Let these traces through again (their partition went elsewhere un-committed)."""
        for trace_id in trace_ids:
            self.recent.discard(("trace", trace_id))

    def set_contracts(self, contracts: list[ModelContract]) -> None:
        table = ContractTable()
        for contract in contracts:
            table.add(contract)
        self.contracts = table

    def _measure(self, record: Record, trace: Trace, started: float) -> Measured:
        h = trace.header
        m = head_metrics(trace.weights, trace.valid, scratch=self._scratch, with_mass=True)
        assert m.row_mass is not None and m.hidden_mass is not None
        check_mass(trace, m.row_mass, m.hidden_mass, self.limits)  # decode's last checks, on this pass's sums
        anomalies = self.detector.observe(Observation(
            h.model_id, h.model_revision, h.layer, h.key_count, h.heads, m.entropy, m.concentration,
            m.sink_share, m.similarity, float(m.diversity)))
        return Measured(trace_identity(trace, record), tuple(h.heads), m.entropy.tolist(), m.concentration.tolist(),
                        m.sink_share.tolist(), float(m.diversity), float(m.effective_heads),
                        time.perf_counter() - started, anomalies)


def trace_identity(trace: Trace, record: Record) -> dict[str, Any]:
    h = trace.header
    return {
        "trace_id": h.trace_id, "request_id": h.request_id, "model_id": h.model_id,
        "model_revision": h.model_revision, "contract_id": h.contract_id, "layer": h.layer,
        "key_count": h.key_count, "trace_timestamp": h.timestamp,
        "source": {"topic": record.topic, "partition": record.partition, "offset": record.offset},
    }
