"""kill -9 of the instance that judges a stream in the middle of a
canary: the survivor takes the stream over from the judge-state topic and the committed
observations, and the anomaly records are exactly those of a run without the kill:
none lost, none written twice.

The traces travel on one partition, so the judge reads one forwarder's traces in one
order in both runs, and the two runs' records can be compared one for one."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from kafka import KafkaAdminClient
from kafka.admin import NewPartitions

from devstack.wait import wait_for
from monitor.tools.scenario import Fault, Scenario
from tests.service.harness import (
    Monitor,
    OutputReader,
    make_topics,
    monitor_env,
    publish_contracts,
    send_requests,
    series,
)

pytestmark = [pytest.mark.kafka, pytest.mark.faults]

HEALTHY = Scenario(revision="rev-1")
CANARY = Scenario(revision="rev-2", faults=(Fault("collapse", 2, (1, 2, 3, 4)),))
CANARY_REQUESTS, BEFORE = 30, 20  #: the canary's requests; those before the kill
READY = [series("attention_reference_ready", layer=layer, model="scenario-lm", revision="rev-1")
         for layer in range(HEALTHY.layers)]


def send(bootstrap: str, topics, scenario: Scenario, rng: np.random.Generator, requests: range) -> None:
    """The same requests at the same times in both runs."""
    send_requests(bootstrap, topics, scenario, rng, requests, lambda i: "failure" if scenario.faults else "success",
                  timestamp=lambda i: 1_000_000.0 + i)


def findings(records: list[dict]) -> list[tuple]:
    """Each anomaly record's trace, finding and effect size (to 6 digits: the judge's
    chunks differ between runs, and numpy's sums over arrays of other lengths differ in
    the last bits)."""
    return sorted((d["request_id"], d["layer"], d["kind"], tuple(d["heads"]), float(f"{d['effect_size']:.6g}"))
                  for d in records if d.get("schema") == "attention-anomaly/1")


def requests_found(got: dict[str, list[dict]], topic: str) -> set[str]:
    return {str(d.get("request_id")) for d in got[topic] if d.get("schema") == "attention-anomaly/1"}


def run(kafka_broker, make_topic, tmp_path: Path, kill: bool) -> tuple[list[tuple], list[str], str]:
    topics = make_topics(make_topic, partitions=1)
    admin = KafkaAdminClient(**kafka_broker.client_config())
    try:  # traces and outcomes on one partition; the judges' topics on two
        admin.create_partitions({t: NewPartitions(2) for t in (topics.observations, topics.judge_state)})
    finally:
        admin.close()
    publish_contracts(kafka_broker.bootstrap, topics, [HEALTHY.contract(), CANARY.contract()])
    group = f"takeover-{kill}-{tmp_path.name}"
    monitors = []
    for i in range(2 if kill else 1):
        (tmp_path / f"m{i}").mkdir(parents=True)
        env = monitor_env(kafka_broker.bootstrap, topics, group, tmp_path / f"m{i}", measure_processes=0,
                          client_id=f"takeover-{i}", session_timeout_ms=6000, heartbeat_interval_ms=1000,
                          state_save_interval_s=30,  # the shipped interval
                          reference_pins="scenario-lm@rev-2=rev-1")
        monitors.append(Monitor(env, tmp_path / f"m{i}.log", name=f"monitor-{i}"))
    reader = OutputReader(kafka_broker.bootstrap, topics.anomalies)
    rng = np.random.default_rng(5)
    try:
        for m in monitors:
            m.wait_ready(timeout=90)
        if kill:
            admin = KafkaAdminClient(**kafka_broker.client_config())
            try:
                wait_for(lambda: (d := admin.describe_groups([group])[group])["group_state"] == "Stable"
                         and len(d["members"]) == 2, timeout=90, what="both instances in the group")
            finally:
                admin.close()
        send(kafka_broker.bootstrap, topics, HEALTHY, rng, range(30))
        wait_for(lambda: all(sum(m.value(r) for m in monitors) == 1 for r in READY), timeout=120,
                 what="rev-1's references ready")
        # the page threshold of a 30-trace reference allows for its estimation error: the canary pages on
        # about its 16th request
        send(kafka_broker.bootstrap, topics, CANARY, rng, range(BEFORE))
        reader.wait(lambda got: requests_found(got, topics.anomalies) >= {f"rev-2-{i}" for i in range(BEFORE)}
                    and any(d.get("change") == "opened" for d in got[topics.anomalies]),
                    timeout=120, what=f"the canary's first {BEFORE} requests found, its incident opened")
        survivor = monitors[0]
        if kill:
            judge, survivor = sorted(monitors, key=lambda m: -m.value("attention_monitor_observations_judged_total"))
            judge.process.kill()
        send(kafka_broker.bootstrap, topics, CANARY, rng, range(BEFORE, CANARY_REQUESTS))
        reader.wait(lambda got: requests_found(got, topics.anomalies) >= {f"rev-2-{i}" for i in range(CANARY_REQUESTS)},
                    timeout=180, what="the canary's last ten requests found")
        reader.settle(quiet=5.0)  # a record written twice would come now
        # the fault's incident is open where it is judged now: its alert neither resolves nor pages again
        assert survivor.value(series("attention_incident_open", family="head", layer=2, model="scenario-lm",
                                     revision="rev-2")) == 1
        opened = [d["incident_id"] for d in reader.records[topics.anomalies]
                  if d.get("schema") == "attention-incident/1" and d.get("change") == "opened"]
        return findings(reader.records[topics.anomalies]), opened, survivor.process.log_path.read_text()
    finally:
        reader.close()
        for m in monitors:
            m.process.stop()


def test_kill_9_of_the_judge_mid_canary_loses_and_doubles_no_anomaly_record(kafka_broker, make_topic, tmp_path):
    undisturbed, opened_once, _ = run(kafka_broker, make_topic, tmp_path / "undisturbed", kill=False)
    killed, opened, log = run(kafka_broker, make_topic, tmp_path / "killed", kill=True)
    assert undisturbed and {f[0] for f in undisturbed} == {f"rev-2-{i}" for i in range(CANARY_REQUESTS)}
    assert not [f for f, n in Counter(killed).items() if n > 1]  # nothing written twice
    assert killed == undisturbed  # nothing lost, nothing different: the same evidence, restored
    assert "judge keys' state and" in log and "traces judged again" in log
    assert len(opened_once) == 1 and len(opened) == 1, (opened_once, opened)  # the fault's one incident, kept
