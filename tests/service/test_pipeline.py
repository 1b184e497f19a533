"""The pipeline on plain records (no Kafka): commit bounds, failures that must not stall."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

import monitor.measuring.measurer as measure_module
from monitor.core.detect import Anomaly, DetectorConfig
from monitor.core.outcome import Outcome
from monitor.core.verdict import Verdict
from monitor.measuring.measurer import MeasurerSpec
from monitor.measuring.workers import Measuring
from monitor.protocol import judge_state, observations
from monitor.protocol.codec import Limits
from monitor.protocol.model_contract import ContractTable
from monitor.protocol.records import Output, Record, TraceIdentity
from monitor.protocol.topics import Topics
from monitor.service.exporter import MonitorMetrics
from monitor.service.pipeline import Pipeline
from tests.factories import CONTRACT, KEYRING, SCOPES, make_record

TRACES, OUTCOMES, OBSERVATIONS = Topics().traces, Topics().outcomes, Topics().observations


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make_pipeline():
    made = []

    def make(clock=None, **settings):
        contracts = ContractTable()
        contracts.add(CONTRACT)
        measuring = Measuring(MeasurerSpec(KEYRING, SCOPES, Limits(), DetectorConfig(), dedupe_window=1000), 0)
        measuring.sync_contracts(contracts)
        registry = CollectorRegistry()
        pipe = Pipeline(measuring, metrics=MonitorMetrics(registry), join_ttl=10, clock=clock or Clock(), **settings)
        made.append((pipe, measuring))
        return pipe, registry

    yield make
    for pipe, measuring in made:
        pipe.close()
        measuring.close()


def run(pipe: Pipeline, *records: Record) -> list[Output]:
    return pipe.process(list(records)).result().outputs


def trace(offset, partition=0, seed=None):
    return Record(TRACES, partition, offset, b"k", make_record(seed if seed is not None else offset))


def test_commits_are_held_back_to_the_oldest_waiting_trace(make_pipeline):
    clock = Clock()
    pipe, _ = make_pipeline(clock)
    outcomes = [Record(OUTCOMES, 0, 4, b"r", b'{"request_id": "no-such-request", "outcome": "success"}')]
    batch = pipe.process([trace(10), trace(11), trace(12), *outcomes]).result()
    assert batch.positions == {(TRACES, 0): 13, (OUTCOMES, 0): 5}
    assert batch.committable == {(TRACES, 0): 10, (OUTCOMES, 0): 4}
    clock.now = 11  # past the TTL: the traces leave pending, the outcome unmatched
    assert pipe.process([]).result().committable == {(TRACES, 0): 13, (OUTCOMES, 0): 5}


def test_each_batch_carries_the_progress_of_every_batch_before_it(make_pipeline):
    """With several batches in flight, a batch's positions and commits include what
    earlier batches reached on partitions it has no records of; a snapshot taken when
    it was polled would take those partitions back."""
    pipe, _ = make_pipeline()
    bad = b"{}"  # refused outcomes: nothing waits in the join buffer
    first = pipe.process([Record("o", 0, 0, None, bad), Record("o", 0, 1, None, bad)])
    second = pipe.process([Record("o", 1, 5, None, bad)])
    first.result()
    batch = second.result()
    assert batch.positions == {("o", 0): 2, ("o", 1): 6}
    assert batch.committable == {("o", 0): 2, ("o", 1): 6}


def test_an_unexpected_failure_after_decoding_is_a_counted_reject_and_the_next_record_flows(monkeypatch,
                                                                                          make_pipeline):
    pipe, registry = make_pipeline()
    real = measure_module.head_metrics
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise FloatingPointError("simulated")
        return real(*args, **kwargs)

    monkeypatch.setattr(measure_module, "head_metrics", flaky)
    out = run(pipe, trace(0))
    assert [json.loads(o.value)["reason"] for o in out] == ["malformed"]
    assert json.loads(out[0].value)["verified_header"]["model_id"] == "test-model"
    assert run(pipe, trace(1)) == []  # measured, waiting for its outcome
    assert registry.get_sample_value("attention_monitor_traces_rejected_total", {"reason": "malformed"}) == 1
    assert registry.get_sample_value("attention_traces_total",
                                     {"model": "test-model", "revision": "rev-1", "layer": "0"}) == 1


def test_malformed_outcomes_are_dead_lettered(make_pipeline):
    pipe, registry = make_pipeline()
    out = run(pipe, Record(OUTCOMES, 0, 3, b"r", b'{"request_id": "r", "outcome": "maybe"}'))
    assert json.loads(out[0].value)["reason"] == "malformed"
    assert registry.get_sample_value("attention_monitor_outcomes_rejected_total", {"reason": "malformed"}) == 1


def test_a_redelivered_trace_is_skipped_by_trace_id(make_pipeline):
    pipe, registry = make_pipeline()
    record = trace(0)
    run(pipe, record)
    run(pipe, Record(record.topic, record.partition, 1, record.key, record.value))
    assert registry.get_sample_value("attention_monitor_duplicates_total") == 1
    assert registry.get_sample_value("attention_traces_total",
                                     {"model": "test-model", "revision": "rev-1", "layer": "0"}) == 1


def test_mass_faults_are_rejected_from_the_metrics_pass_with_decodes_reasons(make_pipeline):
    from monitor.protocol.codec import encode
    from tests.factories import KEY_ID, SECRET, make_trace

    pipe, registry = make_pipeline()
    header, weights = make_trace(4)
    leaky = weights.copy()
    leaky[2, 0, -1] = 0.2  # row 0's causal mask hides the last key
    heavy = weights.copy()
    heavy[3, -1] *= 1.2
    reasons = []
    for offset, w in enumerate((leaky, heavy)):
        out = run(pipe, Record(TRACES, 0, offset, b"k", encode(header.model_copy(
            update={"trace_id": f"t{offset}"}), w, KEY_ID, SECRET)))
        reasons.append(json.loads(out[0].value)["reason"])
    assert reasons == ["masked_mass", "row_sum"]
    assert registry.get_sample_value("attention_traces_total",
                                     {"model": "test-model", "revision": "rev-1", "layer": "0"}) is None
    for reason in ("masked_mass", "row_sum"):
        assert registry.get_sample_value("attention_monitor_traces_rejected_total", {"reason": reason}) == 1


def test_joined_traces_leave_for_their_judge_and_the_records_given_to_the_judge_are_judged(make_pipeline):
    """A trace leaves for its judge once joined, with its outcome, one record per judge
    key; the records given to the judge are judged; one it cannot read is dead-lettered
    and counted, and its partition moves on."""
    pipe, registry = make_pipeline()
    traces = [Record(TRACES, 0, i, b"k", make_record(i, request_id=f"req-{i}")) for i in range(3)]
    outcomes = [Record(OUTCOMES, 0, i, b"k", json.dumps({"request_id": f"req-{i}", "outcome": o}).encode())
                for i, o in enumerate(("success", "failure"))]
    out = run(pipe, *traces, *outcomes)
    (forwarded,) = [o for o in out if o.topic == OBSERVATIONS]  # req-2 still waits for its outcome
    assert observations.parse_key(forwarded.key) == ("test-model", "rev-1")
    entries = observations.decode(forwarded.value)
    assert [(e.identity.request_id, e.outcome.result) for e in entries] == [("req-0", "success"), ("req-1", "failure")]
    assert not [o for o in out if o.topic == Topics().anomalies]
    assert registry.get_sample_value("attention_reference_traces", LAYER) == 0  # not judged here

    out = run(pipe, Record(OBSERVATIONS, 0, 0, forwarded.key, forwarded.value),
              Record(OBSERVATIONS, 0, 1, forwarded.key, b"garbage"))
    assert registry.get_sample_value("attention_reference_traces", LAYER) == 2  # judged: learning
    assert registry.get_sample_value("attention_traces_unjudged_total", {**LAYER, "reason": "learning"}) == 2
    (dead,) = [json.loads(o.value) for o in out if o.topic == Topics().dead_letter]
    assert dead["reason"] == "malformed" and "observations record" in dead["detail"]
    assert registry.get_sample_value("attention_monitor_traces_rejected_total", {"reason": "malformed"}) == 1
    assert pipe.process([]).result().committable[(OBSERVATIONS, 0)] == 2  # nothing held back


LAYER = {"model": "test-model", "revision": "rev-1", "layer": "0"}


def forwarded(pipe: Pipeline, n: int) -> Output:
    """The observations record that ``n`` traces joined to their outcomes leave in."""
    traces = [Record(TRACES, 0, i, b"k", make_record(i, request_id=f"req-{i}")) for i in range(n)]
    outcomes = [Record(OUTCOMES, 0, i, b"k", json.dumps({"request_id": f"req-{i}", "outcome": "success"}).encode())
                for i in range(n)]
    (record,) = [o for o in run(pipe, *traces, *outcomes) if o.topic == OBSERVATIONS]
    return record


def round_keys(outputs: list[Output], partition: int) -> set[tuple[str, str]]:
    """The judge keys with state in the rounds written to ``partition`` of the judge-state topic."""
    return {tuple(o.key.decode().split("\x00")[:2]) for o in outputs
            if o.topic == Topics().judge_state and o.partition == partition and o.key != judge_state.MARKER}


def test_a_judges_partition_kept_through_a_rebalance_keeps_the_keys_it_took_over_in_its_rounds(make_pipeline):
    """A partition taken over and kept by the next rebalance before any of its records
    was read keeps the state of the keys it took over in its next round (it lost them:
    the round after named only keys read since, and the next owner's takeover then
    started the others afresh, their references forgotten)."""
    first, _ = make_pipeline()
    record = forwarded(first, 3)
    run(first, Record(OBSERVATIONS, 2, 0, record.key, record.value))  # rev-1 learns from 3 traces
    key = ("test-model", "rev-1")
    (state,) = first.measuring.key_states([key]).result()
    assert state.by_layer()  # there is something to lose

    second, _ = make_pipeline(state_interval=0.0)  # a round with every batch
    second.measuring.restore([state])  # as take_over leaves a partition it took over
    second.judges.restored(2, [key], committed=1)
    second.reassign({}, set(), set())  # a rebalance keeps partition 2; none of its records read yet
    other = observations.judge_key("test-model", "rev-0")  # another key of the partition, pinned to rev-0
    outputs = run(second, Record(OBSERVATIONS, 2, 1, other, record.value))
    assert round_keys(outputs, 2) == {key}  # rev-0 has learned nothing: it judges by a reference not made


@pytest.mark.parametrize("moved", [True, False])
def test_an_incident_whose_judge_moved_away_goes_quiet_here_without_a_closed_record(make_pipeline, moved):
    """A judge key's partition went to another instance with its open incident (in the
    round the new judge restores): here the incident closes once quiet without writing
    "closed", which would contradict the new judge while the fault goes on; its gauge
    stays up until then (the alert takes the max over instances: no dip while the new
    judge takes over). Kept, it closes with its record as ever."""
    clock = Clock()
    pipe, registry = make_pipeline(clock, incident_quiet=600.0)
    pipe.judges.restored(2, [("test-model", "rev-1")], committed=0)  # this instance judges rev-1 on partition 2
    identity = TraceIdentity("t-1", "req-1", "test-model", "rev-1", "c", 0, 32, 1.0, (OBSERVATIONS, 2, 0))
    collapsed = Anomaly("low_diversity", 0, ("head-1", "head-2"), 0.1, 0.6, 9.0, 20.0, "rev-1", True)
    opened = pipe.findings.judged(identity, Verdict([collapsed], "rev-1", False, 30, True), Outcome("failure"),
                                  identity.source)
    assert [json.loads(o.value)["change"] for o in opened if b"attention-incident" in o.value] == ["opened"]
    open_gauge = {**LAYER, "family": "diversity"}
    pipe.reassign({}, {(OBSERVATIONS, 2)} if moved else set(), set())
    clock.now = 599.0
    assert not [o for o in run(pipe) if b"attention-incident" in o.value]
    assert registry.get_sample_value("attention_incident_open", open_gauge) == 1
    clock.now = 600.0
    closed = [json.loads(o.value)["change"] for o in run(pipe) if b"attention-incident" in o.value]
    assert closed == ([] if moved else ["closed"])
    assert registry.get_sample_value("attention_incident_open", open_gauge) == 0
