"""The pipeline on plain records (no Kafka): commit bounds, failures that must not stall."""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry

import monitor.stage as stage_module
from monitor.core.detect import Detector
from monitor.exporter import MonitorMetrics
from monitor.model_contract import ContractTable
from monitor.pipeline import Pipeline, Record, Topics
from tests.factories import CONTRACT, KEYRING, SCOPES, make_record


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def make_pipeline(clock=None):
    contracts = ContractTable()
    contracts.add(CONTRACT)
    registry = CollectorRegistry()
    pipe = Pipeline(keyring=KEYRING, scopes=SCOPES, contracts=contracts, detector=Detector(),
                    metrics=MonitorMetrics(registry), join_ttl=10, clock=clock or Clock())
    return pipe, registry


def trace(offset, partition=0, seed=None):
    return Record(Topics().traces, partition, offset, b"k", make_record(seed if seed is not None else offset))


def test_commits_are_held_back_to_the_oldest_waiting_trace():
    clock = Clock()
    pipe, _ = make_pipeline(clock)
    for offset in (10, 11, 12):
        pipe.process(trace(offset))
    positions = {(Topics().traces, 0): 13, (Topics().outcomes, 0): 5}
    assert pipe.committable(positions) == {(Topics().traces, 0): 10, (Topics().outcomes, 0): 5}
    clock.now = 11  # past the TTL: the traces leave with outcome "missing"
    pipe.expire()
    assert pipe.committable(positions)[(Topics().traces, 0)] == 13


def test_an_unexpected_failure_after_decoding_is_a_counted_reject_and_the_next_record_flows(monkeypatch):
    pipe, registry = make_pipeline()
    real = stage_module.head_metrics
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise FloatingPointError("simulated")
        return real(*args, **kwargs)

    monkeypatch.setattr(stage_module, "head_metrics", flaky)
    out = pipe.process(trace(0))
    assert [json.loads(o.value)["reason"] for o in out] == ["malformed"]
    assert json.loads(out[0].value)["verified_header"]["model_id"] == "test-model"
    assert pipe.process(trace(1)) == []  # measured, waiting for its outcome
    assert registry.get_sample_value("attention_monitor_traces_rejected_total", {"reason": "malformed"}) == 1
    assert registry.get_sample_value("attention_traces_total",
                                     {"model": "test-model", "revision": "rev-1", "layer": "0"}) == 1


def test_malformed_outcomes_are_dead_lettered():
    pipe, registry = make_pipeline()
    out = pipe.process(Record(Topics().outcomes, 0, 3, b"r", b'{"request_id": "r", "outcome": "maybe"}'))
    assert json.loads(out[0].value)["reason"] == "malformed"
    assert registry.get_sample_value("attention_monitor_outcomes_rejected_total", {"reason": "malformed"}) == 1


def test_a_redelivered_trace_is_skipped_by_trace_id():
    pipe, registry = make_pipeline()
    record = trace(0)
    pipe.process(record)
    pipe.process(Record(record.topic, record.partition, 1, record.key, record.value))
    assert registry.get_sample_value("attention_monitor_duplicates_total") == 1
    assert registry.get_sample_value("attention_traces_total",
                                     {"model": "test-model", "revision": "rev-1", "layer": "0"}) == 1


def test_mass_faults_are_rejected_from_the_metrics_pass_with_decodes_reasons():
    from monitor.codec import encode
    from tests.factories import KEY_ID, SECRET, make_trace

    pipe, registry = make_pipeline()
    header, weights = make_trace(4)
    leaky = weights.copy()
    leaky[2, 0, -1] = 0.2  # row 0's causal mask hides the last key
    heavy = weights.copy()
    heavy[3, -1] *= 1.2
    reasons = []
    for offset, w in enumerate((leaky, heavy)):
        out = pipe.process(Record(Topics().traces, 0, offset, b"k", encode(header.model_copy(
            update={"trace_id": f"t{offset}"}), w, KEY_ID, SECRET)))
        reasons.append(json.loads(out[0].value)["reason"])
    assert reasons == ["masked_mass", "row_sum"]
    assert registry.get_sample_value("attention_traces_total",
                                     {"model": "test-model", "revision": "rev-1", "layer": "0"}) is None
    for reason in ("masked_mass", "row_sum"):
        assert registry.get_sample_value("attention_monitor_traces_rejected_total", {"reason": reason}) == 1
