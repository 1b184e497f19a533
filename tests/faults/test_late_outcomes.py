"""Outcomes as users give them, through the real broker and ``attention-monitor run``:
late (after the join window, across a restart), duplicated, for unknown requests, past
their window (a small one: 30 s stands for days), and more requests waiting than the
table holds. Nothing lost, nothing doubled, no unbounded growth; no commit held past the
join."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from devstack.wait import wait_for
from monitor.producer import TraceProducer
from monitor.tools.scenario import Fault, Scenario
from tests.factories import KEY_ID, SECRET
from tests.service.harness import Monitor, OutputReader, make_topics, monitor_env, publish_contracts, series

pytestmark = [pytest.mark.kafka]

HEALTHY = Scenario(revision="rev-1")
CANARY = Scenario(revision="rev-2", faults=(Fault("collapse", 2, (1, 2, 3, 4)),))
WINDOW = 30.0  #: OUTCOME_WINDOW_S here: 30 s for the default 3 days
MAX_REQUESTS = 40
LAYER2 = {"model": "scenario-lm", "revision": "rev-2", "layer": "2"}


def send(bootstrap, topics, scenario: Scenario, requests: range, rng, outcome=None, at: float | None = None) -> float:
    """Requests' traces (and, when ``outcome`` is given, their outcomes); returns when."""
    sent = time.time() if at is None else at
    with TraceProducer(key_id=KEY_ID, secret=SECRET, topics=topics, bootstrap_servers=bootstrap) as producer:
        for i in requests:
            for header, weights in scenario.request(rng, f"{scenario.revision}-{i}", timestamp=sent):
                producer.send(header, weights)
            if outcome is not None:
                producer.send_outcome(f"{scenario.revision}-{i}", outcome)
    return sent


def outcomes(bootstrap, topics, *given: tuple[str, dict]) -> None:
    with TraceProducer(key_id=KEY_ID, secret=SECRET, topics=topics, bootstrap_servers=bootstrap) as producer:
        for request_id, fields in given:
            producer.send_outcome(request_id, **fields)


def test_late_duplicate_unknown_and_expired_outcomes_through_a_restart(kafka_broker, make_topic, tmp_path: Path):
    bootstrap = kafka_broker.bootstrap
    topics = make_topics(make_topic, partitions=2)
    publish_contracts(bootstrap, topics, [HEALTHY.contract(), CANARY.contract()])
    env = monitor_env(bootstrap, topics, f"late-{tmp_path.name}", tmp_path, measure_processes=0, join_ttl_s=2,
                      outcome_window_s=WINDOW, outcome_max_requests=MAX_REQUESTS,
                      reference_pins="scenario-lm@rev-2=rev-1")
    reader = OutputReader(bootstrap, topics.anomalies)
    rng = np.random.default_rng(5)
    monitor = Monitor(env, tmp_path / "first.log", "first")
    try:
        monitor.wait_ready(timeout=90)
        send(bootstrap, topics, HEALTHY, range(30), rng, outcome="success")
        canary_at = send(bootstrap, topics, CANARY, range(6), rng)  # no outcome yet
        monitor.wait_until(lambda: monitor.value(series("attention_trace_outcomes_pending", **LAYER2)) == 6,
                           timeout=60, what="the canary's six requests pending past the join window")
        records = reader.wait(lambda r: len({d["request_id"] for d in r[topics.anomalies]
                                             if d.get("schema") == "attention-anomaly/1"}) == 6,
                              timeout=30, what="the canary's anomaly records")
        assert {d["outcome"] for d in records[topics.anomalies] if d.get("schema") == "attention-anomaly/1"} == \
            {"pending"}
        # the join holds no commit: every trace offset committed although no outcome came
        monitor.wait_until(lambda: monitor.value("attention_monitor_join_entries") == 0, timeout=30,
                           what="the join empty")

        outcomes(bootstrap, topics, ("rev-2-0", {"label": "thumbs_down", "score": 0.1}),
                 ("rev-2-1", {"outcome": "failure", "label": "regenerate"}),
                 ("rev-2-0", {"label": "thumbs_down"}),  # a duplicate
                 ("never-traced", {"outcome": "failure"}))
        monitor.wait_until(lambda: monitor.value("attention_monitor_outcomes_late_total") == 2, timeout=30,
                           what="two late outcomes attributed")
        assert monitor.value(series("attention_trace_outcomes_total", outcome="failure", **LAYER2)) == 2
        monitor.wait_until(lambda: monitor.value("attention_monitor_outcomes_unmatched_total") == 2, timeout=30,
                           what="the duplicate and the unknown outcome unmatched")
        monitor.process.stop()  # SIGTERM: the last batch committed

        monitor = Monitor(env, tmp_path / "second.log", "second")
        monitor.wait_ready(timeout=90)
        monitor.wait_until(lambda: monitor.value("attention_monitor_pending_requests") == 4, timeout=30,
                           what="the four requests still awaiting an outcome rebuilt")
        outcomes(bootstrap, topics, ("rev-2-2", {"label": "escalated"}), ("rev-2-0", {"label": "thumbs_down"}))
        monitor.wait_until(lambda: monitor.value("attention_monitor_outcomes_late_total") == 1, timeout=30,
                           what="the late outcome after the restart attributed")
        assert monitor.value(series("attention_trace_outcomes_pending", **LAYER2)) == 3

        wait_for(lambda: time.time() > canary_at + WINDOW + 1, timeout=WINDOW + 5, what="the canary's window over")
        outcomes(bootstrap, topics, ("rev-2-3", {"outcome": "failure"}))  # too late
        send(bootstrap, topics, HEALTHY, range(100, 102), rng, outcome="success")  # event time moves on
        monitor.wait_until(lambda: monitor.value(series("attention_trace_outcomes_total", outcome="missing",
                                                        **LAYER2)) == 3, timeout=30,
                           what="the three requests whose window closed counted missing")
        assert monitor.value(series("attention_trace_outcomes_total", outcome="failure", **LAYER2)) == 1
        assert monitor.value("attention_monitor_pending_evictions_total{reason=window}") == 3

        records = reader.wait(lambda r: {d["request_id"] for d in r[topics.anomalies]
                                         if d.get("schema") == "attention-outcome/1"} >= {"rev-2-0", "rev-2-1",
                                                                                          "rev-2-2"},
                              timeout=30, what="the late outcomes' records")
        reader.settle()
        late = [d for d in reader.records[topics.anomalies] if d.get("schema") == "attention-outcome/1"]
        assert sorted(d["request_id"] for d in late) == ["rev-2-0", "rev-2-1", "rev-2-2"]  # once each
        first = next(d for d in late if d["request_id"] == "rev-2-0")
        assert (first["outcome"], first["label"], first["score"]) == ("failure", "thumbs_down", 0.1)
        assert first["reference_revision"] == "rev-1" and first["late_by_s"] > 2
        layer2 = next(layer for layer in first["layers"] if layer["layer"] == 2)
        assert layer2["kinds"]  # the judge remembered the kinds of its findings
        assert layer2["reference_outcomes"]["revision"] == "rev-1" and layer2["reference_outcomes"]["success"] == 30

        # more requests awaiting an outcome than the table holds: the oldest leave, counted
        send(bootstrap, topics, HEALTHY, range(200, 200 + MAX_REQUESTS + 15), rng)
        monitor.wait_until(lambda: monitor.value("attention_monitor_pending_evictions_total{reason=capacity}") >= 15,
                           timeout=60, what="requests pushed out beyond OUTCOME_MAX_REQUESTS")
        assert monitor.value("attention_monitor_pending_requests") <= MAX_REQUESTS
    finally:
        reader.close()
        monitor.process.stop()
