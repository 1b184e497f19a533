"""Readiness and reference decisions on the real broker and service: pins through
``attention-monitor reference pin``, visible on /metrics, in the log and in
``attention-monitor status``; kept in the state across a restart without the setting;
ended only by ``reference promote``."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from kafka import KafkaConsumer, TopicPartition

from devstack.wait import wait_for
from monitor.protocol import observations
from monitor.tools.scenario import Scenario
from tests.service.harness import (
    REPO,
    Monitor,
    make_topics,
    monitor_env,
    publish_contracts,
    send_requests,
    send_traces,
    series,
)

pytestmark = pytest.mark.kafka
HEALTHY, NEXT = Scenario(revision="rev-1"), Scenario(revision="rev-2")


def traces(scenario: Scenario, seed: int, requests: int):
    rng = np.random.default_rng(seed)
    return [trace for i in range(requests) for trace in scenario.request(rng, f"{scenario.revision}-{seed}-{i}")]


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "monitor", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def judge(monitor: Monitor, revision: str, layer: int = 0) -> dict[str, float]:
    prefix = "attention_reference_judge{"
    return {k: v for k, v in monitor.metrics().items()
            if k.startswith(prefix) and f"revision={revision}" in k and f"layer={layer}," in k}


def test_a_pin_is_visible_kept_across_a_restart_and_ended_only_by_a_promotion(kafka_broker, make_topic, tmp_path):
    topics = make_topics(make_topic)
    publish_contracts(kafka_broker.bootstrap, topics, [HEALTHY.contract(), NEXT.contract()])
    env = monitor_env(kafka_broker.bootstrap, topics, f"refs-{tmp_path.name}", tmp_path)
    monitor = Monitor(env, tmp_path / "monitor.log")
    try:
        monitor.wait_ready()
        send_traces(kafka_broker.bootstrap, topics.traces, traces(HEALTHY, 1, 30))
        ready = series("attention_reference_ready", layer="0", model="scenario-lm", revision="rev-1")
        wait_for(lambda: monitor.value(ready) == 1, timeout=60, what="rev-1's reference ready")
        assert "reference of scenario-lm rev-1 layer 0 ready (30 traces" in monitor.process.log_path.read_text()

        pinned = cli(env, "reference", "pin", "scenario-lm@rev-2", "--to", "rev-1", "--by", "on-call")
        assert pinned.returncode == 0, pinned.stderr
        wait_for(lambda: "scenario-lm rev-2 pinned to the reference of rev-1 (by on-call)"
                 in monitor.process.log_path.read_text(), timeout=30, what="the pin applied")
        send_traces(kafka_broker.bootstrap, topics.traces, traces(NEXT, 2, 5))
        wait_for(lambda: judge(monitor, "rev-2"), timeout=60, what="rev-2 judged")
        assert list(judge(monitor, "rev-2")) == [series("attention_reference_judge", layer="0", model="scenario-lm",
                                                        reference="rev-1", revision="rev-2")]
        status = cli(env, "status")
        assert status.returncode == 0, status.stderr
        row = next(line for line in status.stdout.splitlines() if " rev-2 " in line and line.split()[2] == "0")
        assert row.split()[3:5] == ["rev-1", "30/30"]
        assert "scenario-lm rev-2: pinned to rev-1 (pin)" in status.stdout
    finally:
        monitor.process.stop()  # the state is saved on the way out

    restarted = Monitor(env, tmp_path / "restarted.log", "restarted")  # no pin in its settings
    try:
        restarted.wait_ready()
        send_traces(kafka_broker.bootstrap, topics.traces, traces(NEXT, 3, 5))
        wait_for(lambda: "is judged by the reference of rev-1" in restarted.process.log_path.read_text(),
                 timeout=60, what="the saved pin in effect after the restart")
        unjudged = series("attention_traces_unjudged_total", layer="0", model="scenario-lm", reason="learning",
                          revision="rev-2")
        assert restarted.value(unjudged) == 0  # rev-2 never learnt from its own traces

        promoted = cli(env, "reference", "promote", "scenario-lm@rev-2", "--by", "on-call")
        assert promoted.returncode == 0, promoted.stderr
        wait_for(lambda: "rev-2 promoted to be its own reference (by on-call)"
                 in restarted.process.log_path.read_text(), timeout=30, what="the promotion applied")
        send_traces(kafka_broker.bootstrap, topics.traces, traces(NEXT, 4, 5))
        wait_for(lambda: restarted.value(unjudged) == 5, timeout=60, what="rev-2 learning its own reference")
        listed = cli(env, "reference", "list")
        assert "scenario-lm@rev-2: promoted by on-call" in listed.stdout, listed.stdout + listed.stderr
    finally:
        restarted.process.stop()
    assert "scenario-lm rev-2: its own reference (promoted)" in cli(env, "status").stdout
    assert cli(env, "reference", "pin", "scenario-lm@rev-2", "--to", "rev-2").returncode == 2  # not itself


def test_a_pin_naming_a_revision_no_contract_has_is_reported(kafka_broker, make_topic, tmp_path):
    """The canary's traces carry rev-2, the operator pinned 'rev-2-derived': the pin does
    nothing, and /metrics, the log and ``status`` say so until the pin names a revision a
    contract has."""
    topics = make_topics(make_topic)
    publish_contracts(kafka_broker.bootstrap, topics, [HEALTHY.contract()])
    env = monitor_env(kafka_broker.bootstrap, topics, f"unmatched-{tmp_path.name}", tmp_path)
    env["ATTENTION_MONITOR_REFERENCE_PINS"] = "scenario-lm@rev-2-derived=rev-1"
    monitor = Monitor(env, tmp_path / "monitor.log")
    unmatched = series("attention_monitor_pin_unmatched", model="scenario-lm", reference="rev-1",
                       revision="rev-2-derived")
    try:
        monitor.wait_ready()
        assert monitor.value(unmatched) == 1
        log = monitor.process.log_path.read_text()
        assert "pinned to the reference of rev-1 under revision rev-2-derived, which no contract has yet" in log

        publish_contracts(kafka_broker.bootstrap, topics, [NEXT.contract()])  # the canary arrives as rev-2
        send_traces(kafka_broker.bootstrap, topics.traces, traces(NEXT, 5, 3))
        wait_for(lambda: "while contracts of scenario-lm arrive for rev-2: if one of those is the revision you "
                 "meant to pin, it is not pinned" in monitor.process.log_path.read_text(), timeout=60,
                 what="the warning naming the canary's revision")
        wait_for(lambda: monitor.value(series("attention_traces_total", layer="0", model="scenario-lm",
                                              revision="rev-2")) == 3, timeout=60, what="rev-2's traces counted")
        status = cli(env, "status")
        assert ("WARNING: scenario-lm rev-2-derived is pinned to rev-1, but no contract has revision rev-2-derived: "
                "traces of scenario-lm carry rev-2") in status.stdout, status.stdout

        pinned = cli(env, "reference", "pin", "scenario-lm@rev-2", "--to", "rev-1", "--by", "on-call")
        assert pinned.returncode == 0, pinned.stderr
        promoted = cli(env, "reference", "promote", "scenario-lm@rev-2-derived", "--by", "on-call")
        assert promoted.returncode == 0, promoted.stderr
        wait_for(lambda: unmatched not in monitor.metrics(), timeout=30, what="the wrong pin withdrawn")
        assert not any(k.startswith("attention_monitor_pin_unmatched{") for k in monitor.metrics())
    finally:
        monitor.process.stop()


def test_a_pin_kept_only_in_the_saved_state_routes_the_canary_to_its_reference_revisions_judge(
        kafka_broker, make_topic, tmp_path):
    """A pin from the settings is kept in the saved state; a run without the setting
    still judges the canary by it, and must route the canary's observations to the judge
    of the pinned reference: a judge elsewhere holding only the canary's key would find
    no reference and judge nothing."""
    topics = make_topics(make_topic)
    publish_contracts(kafka_broker.bootstrap, topics, [HEALTHY.contract(), NEXT.contract()])
    env = monitor_env(kafka_broker.bootstrap, topics, f"saved-pin-{tmp_path.name}", tmp_path,
                      measure_processes=0)
    first = Monitor({**env, "ATTENTION_MONITOR_REFERENCE_PINS": "scenario-lm@rev-2=rev-1"}, tmp_path / "first.log")
    try:
        first.wait_ready()
        send_requests(kafka_broker.bootstrap, topics, HEALTHY, np.random.default_rng(1), range(30), lambda i: "success")
        ready = series("attention_reference_ready", layer="0", model="scenario-lm", revision="rev-1")
        wait_for(lambda: first.value(ready) == 1, timeout=90, what="rev-1's reference ready")
    finally:
        first.process.stop()  # the state, with the pin, is saved on the way out

    restarted = Monitor(env, tmp_path / "restarted.log", "restarted")  # no pin in its settings
    try:
        restarted.wait_ready()
        send_requests(kafka_broker.bootstrap, topics, NEXT, np.random.default_rng(2), range(3), lambda i: "success")
        judged = series("attention_reference_judge", layer="0", model="scenario-lm", reference="rev-1",
                        revision="rev-2")
        wait_for(lambda: restarted.value(judged) > 0, timeout=90, what="rev-2 judged by rev-1's reference")
    finally:
        restarted.process.stop()
    assert keys_of(kafka_broker.bootstrap, topics.observations)["rev-2"] == {("scenario-lm", "rev-1")}


def keys_of(bootstrap: str, topic: str, partitions: int = 2) -> dict[str, set[tuple[str, str]]]:
    """The judge keys the committed observations of each revision were sent to."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed", enable_auto_commit=False)
    parts = [TopicPartition(topic, p) for p in range(partitions)]
    consumer.assign(parts)
    consumer.seek_to_beginning()
    ends = consumer.end_offsets(parts)
    keys: dict[str, set[tuple[str, str]]] = {}

    def read_all() -> bool:
        for records in consumer.poll(timeout_ms=200).values():
            for r in records:
                for entry in observations.decode(r.value):
                    keys.setdefault(entry.identity.model_revision, set()).add(observations.parse_key(r.key))
        return all(consumer.position(p) >= ends[p] for p in parts)

    try:
        wait_for(read_all, timeout=30, what=f"{topic} read to its end")
    finally:
        consumer.close()
    return keys
