"""Outcomes that come after the join window, on plain records through the pipeline (no
Kafka: ``tests/faults/test_late_outcomes.py`` has the real broker): attributed once,
without holding commits past the join, missing when their window closes, and rebuilt
from what was written by a new owner of the partition."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from monitor.core.detect import DetectorConfig
from monitor.measuring.measurer import MeasurerSpec
from monitor.measuring.workers import Measuring
from monitor.protocol import observations
from monitor.protocol.codec import Limits
from monitor.protocol.model_contract import ContractTable
from monitor.protocol.records import Output, Record
from monitor.protocol.topics import Topics
from monitor.service.exporter import MonitorMetrics
from monitor.service.late import FLUSH_S
from monitor.service.pipeline import Pipeline
from tests.factories import CONTRACT, KEYRING, SCOPES, make_record

TOPICS = Topics()
T0 = 1_700_000_000.0  #: event time of the traces
WINDOW = 100.0
TTL = 10.0


class Clock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Harness:
    """A pipeline whose observation records come back to it as a broker would hand them
    (the judge is this instance), keeping everything else it writes."""

    def __init__(self, make, clock: Clock):
        self.pipe, self.registry = make(clock)
        self.clock = clock
        self.written: list[Output] = []
        self._observations: list[Record] = []
        self._offset = 0

    def run(self, *records: Record) -> list[Output]:
        batch = self.pipe.process(list(records)).result()
        self.committable = batch.committable
        out = self._keep(batch.outputs)
        while self._observations:
            records, self._observations = self._observations, []
            out += self._keep(self.pipe.process(records).result().outputs)
        return out

    def _keep(self, outputs: list[Output]) -> list[Output]:
        rest = []
        for o in outputs:
            if o.topic == TOPICS.observations:
                self._observations.append(Record(o.topic, 0, self._offset, o.key, o.value))
                self._offset += 1
            else:
                rest.append(o)
        self.written += rest
        return rest

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def pending_records(self) -> list[bytes]:
        return [o.value for o in self.written if o.topic == TOPICS.pending]


@pytest.fixture
def make():
    made = []

    def make_pipeline(clock):
        contracts = ContractTable()
        contracts.add(CONTRACT)
        measuring = Measuring(MeasurerSpec(KEYRING, SCOPES, Limits(), DetectorConfig(), dedupe_window=1000), 0)
        measuring.sync_contracts(contracts)
        registry = CollectorRegistry()
        pipe = Pipeline(measuring, metrics=MonitorMetrics(registry), join_ttl=TTL, clock=clock,
                        wall_clock=lambda: T0 + 10 * WINDOW, outcome_window=WINDOW, outcome_max_requests=1000)
        made.append((pipe, measuring))
        return pipe, registry

    yield make_pipeline
    for pipe, measuring in made:
        pipe.close()
        measuring.close()


def traces(requests: range, at: float = T0, offset: int = 0) -> list[Record]:
    """A trace of layers 0 and 1 for each request."""
    out = []
    for n in requests:
        for layer in (0, 1):
            value = make_record(100 * n + layer, layer=layer, request_id=f"req-{n}", timestamp=at)
            out.append(Record(TOPICS.traces, 0, offset + len(out), b"k", value, at))
    return out


def outcome(n: int, offset: int, at: float, **fields) -> Record:
    doc = {"request_id": f"req-{n}", **fields}
    return Record(TOPICS.outcomes, 0, offset, b"k", json.dumps(doc).encode(), at)


LAYER0 = {"model": "test-model", "revision": "rev-1", "layer": "0"}


def test_a_late_outcome_counts_once_a_duplicate_and_an_unknown_one_count_nothing(make):
    clock = Clock()
    h = Harness(make, clock)
    h.run(*traces(range(4)), outcome(0, 0, T0 + 1, outcome="success"))
    assert h.committable[(TOPICS.traces, 0)] == 2  # req-1's first trace waits in the join
    clock.now = TTL + 1  # the join window closes: req-1..3 leave pending, their commits go
    h.run()
    assert h.committable[(TOPICS.traces, 0)] == 8
    assert h.value("attention_trace_outcomes_pending", **LAYER0) == 3
    assert h.value("attention_trace_outcomes_total", outcome="missing", **LAYER0) == 0
    assert h.value("attention_monitor_pending_requests") == 3

    out = h.run(outcome(1, 1, T0 + 50, label="thumbs_down", score=0.1),  # 50 s late: within the window
                outcome(1, 2, T0 + 51, label="thumbs_down"),  # a duplicate
                outcome(9, 3, T0 + 52, outcome="failure"))  # never traced
    (late,) = [json.loads(o.value) for o in out if o.topic == TOPICS.anomalies]
    assert late["schema"] == "attention-outcome/1" and late["request_id"] == "req-1"
    assert (late["outcome"], late["label"], late["score"], late["late_by_s"]) == ("failure", "thumbs_down", 0.1, 50.0)
    assert [layer["layer"] for layer in late["layers"]] == [0, 1]
    assert late["layers"][0]["layer_outcomes"] == {"success": 1, "failure": 1, "missing": 0, "pending": 2}
    assert h.value("attention_trace_outcomes_total", outcome="failure", **LAYER0) == 1
    assert h.value("attention_trace_outcomes_pending", **LAYER0) == 2
    assert h.value("attention_monitor_outcomes_late_total") == 1
    assert h.committable[(TOPICS.outcomes, 0)] == 2  # the duplicate (which replaced it) and the unknown one wait
    clock.now += TTL + FLUSH_S
    h.run()
    assert h.value("attention_monitor_outcomes_unmatched_total") == 2
    assert h.value("attention_trace_outcomes_total", outcome="failure", **LAYER0) == 1  # not doubled
    assert h.committable[(TOPICS.outcomes, 0)] == 4


def test_an_outcome_past_its_window_counts_nothing_and_the_window_closes_missing(make):
    clock = Clock()
    h = Harness(make, clock)
    h.run(*traces(range(2)))
    clock.now = TTL + 1
    h.run()
    clock.now += FLUSH_S
    h.run(outcome(0, 0, T0 + WINDOW + 1, outcome="failure"))  # past req-0's window: it closes now
    assert h.value("attention_trace_outcomes_total", outcome="missing", **LAYER0) == 2
    assert h.value("attention_trace_outcomes_total", outcome="failure", **LAYER0) == 0
    assert h.value("attention_trace_outcomes_pending", **LAYER0) == 0
    assert h.value("attention_monitor_pending_evictions_total", reason="window") == 2
    assert not [o for o in h.written if o.topic == TOPICS.anomalies]


def test_a_new_owner_of_the_partition_rebuilds_the_requests_and_attributes_their_late_outcomes(make):
    clock = Clock()
    first = Harness(make, clock)
    first.run(*traces(range(3)))
    clock.now = TTL + 1
    first.run()
    first.run(outcome(0, 0, T0 + 20, outcome="success"))  # settled: said at once
    assert [json.loads(v)["closed"] for v in first.pending_records()] == [[], ["req-0"]]

    again = Harness(make, Clock())
    assert again.pipe.late.rebuild(0, first.pending_records()) == 2
    assert again.value("attention_trace_outcomes_pending", **LAYER0) == 2
    again.run(outcome(0, 0, T0 + 30, outcome="failure"),  # settled before the move: nothing
              outcome(2, 1, T0 + 40, label="escalated"))
    assert again.value("attention_trace_outcomes_total", outcome="failure", **LAYER0) == 1
    assert again.value("attention_monitor_outcomes_late_total") == 1
    forwarded = [e for o in again.written if o.topic == TOPICS.observations for e in observations.decode(o.value)]
    assert not forwarded  # the traces were judged before the move


def test_every_layer_of_a_pending_request_is_pending(make):
    clock = Clock()
    h = Harness(make, clock)
    h.run(*traces(range(2)))
    clock.now = TTL + 1
    h.run()
    for layer in ("0", "1"):
        assert h.value("attention_trace_outcomes_pending", **{**LAYER0, "layer": layer}) == 2
