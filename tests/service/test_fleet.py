"""Each stream judged in one place on the real broker, so three instances in one group
find a canary as one instance does.

When each instance judged its own partitions (the former default), three instances given
the traffic one reference needs each held a third of it: no reference was ready and
every trace of a collapsed canary went unjudged (measured with the shipped defaults:
65–69 ``no_reference`` per instance, nothing found). Here the same traffic reaches one
judge, wherever it was measured."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from kafka import KafkaAdminClient

from devstack.wait import wait_for
from monitor.protocol.topics import Topics
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
from tests.service.test_references import cli

pytestmark = [pytest.mark.kafka]

HEALTHY = Scenario(revision="rev-1")
CANARY = Scenario(revision="rev-2", faults=(Fault("collapse", 2, (1, 2, 3, 4)),))
REFERENCE_TRACES = 30  #: the harness's: one reference a layer from 30 healthy requests
PARTITIONS = 3


def total(monitors: list[Monitor], name: str) -> float:
    return sum(m.value(name) for m in monitors)


def run(kafka_broker, make_topic, tmp_path: Path, instances: int) -> dict[str, object]:
    """The same traffic through ``instances`` monitors in one group: healthy requests
    enough for one reference, then a collapsed canary pinned to it. What they found."""
    topics = make_topics(make_topic, partitions=PARTITIONS)
    publish_contracts(kafka_broker.bootstrap, topics, [HEALTHY.contract(), CANARY.contract()])
    group = f"fleet-{instances}-{tmp_path.name}"
    monitors = []
    for i in range(instances):
        (tmp_path / f"m{i}").mkdir(parents=True)
        env = monitor_env(kafka_broker.bootstrap, topics, group, tmp_path / f"m{i}", measure_processes=0,
                          client_id=f"fleet-{i}", reference_pins="scenario-lm@rev-2=rev-1")
        monitors.append(Monitor(env, tmp_path / f"m{i}.log", name=f"monitor-{i}"))
    try:
        for m in monitors:
            m.wait_ready(timeout=90)
        admin = KafkaAdminClient(**kafka_broker.client_config())
        try:  # every partition owned before traffic: no rebalance moves a judge meanwhile
            def settled() -> bool:
                described = admin.describe_groups([group])[group]
                return described["group_state"] == "Stable" and len(described["members"]) == instances
            wait_for(settled, timeout=90, what=f"the group of {instances} stable")
        finally:
            admin.close()

        send_requests(kafka_broker.bootstrap, topics, HEALTHY, np.random.default_rng(1), range(REFERENCE_TRACES),
                      lambda i: "success")
        ready = [series("attention_reference_ready", layer=layer, model="scenario-lm", revision="rev-1")
                 for layer in range(HEALTHY.layers)]
        wait_for(lambda: all(total(monitors, r) == 1 for r in ready), timeout=120,
                 what="rev-1's references ready on the fleet")
        counts = [max(m.value(r.replace("reference_ready", "reference_traces")) for m in monitors) for r in ready]

        reader = OutputReader(kafka_broker.bootstrap, topics.anomalies)
        send_requests(kafka_broker.bootstrap, topics, CANARY, np.random.default_rng(2), range(10), lambda i: "failure")
        def canary(got: dict[str, list[dict[str, object]]]) -> list[dict[str, object]]:
            return [d for d in got[topics.anomalies] if d.get("schema") == "attention-anomaly/1"]

        found = reader.wait(lambda got: len({d["request_id"] for d in canary(got)}) == 10, timeout=120,
                            what="every canary request found")
        reader.close()
        findings = canary(found)
        measured = [m.value(series("attention_traces_total", layer=0, model="scenario-lm", revision="rev-1"))
                    for m in monitors]
        urls = [arg for m in monitors for arg in ("--url", f"http://127.0.0.1:{m.port}/metrics")]
        status = cli(monitors[0].env, "status", *urls).stdout  # the fleet's view, from every instance
        rows = [row for row in map(str.split, status.splitlines()) if row[:2] == ["scenario-lm", "rev-1"]]
        judged = [sum(v for k, v in m.metrics().items()
                      if k.startswith("attention_anomalies_total{") and "revision=rev-2" in k) for m in monitors]
        return {"counts": counts, "first": min(int(str(d["request_id"]).rpartition("-")[2]) for d in findings),
                "outcomes": {d["outcome"] for d in findings}, "layers": {d["layer"] for d in findings},
                "kinds": sorted({str(d["kind"]) for d in findings}),
                "measured": measured, "judged": judged, "status": rows}
    finally:
        for m in monitors:
            m.process.stop()


def test_three_instances_find_the_canary_as_one_instance_does(kafka_broker, make_topic, tmp_path):
    one = run(kafka_broker, make_topic, tmp_path / "one", 1)
    three = run(kafka_broker, make_topic, tmp_path / "three", 3)
    for got in (one, three):
        assert got["counts"] == [REFERENCE_TRACES] * HEALTHY.layers  # one reference of all 30 requests a layer
        assert got["first"] == 0  # the canary's first request is found
        assert got["outcomes"] == {"failure"} and got["layers"] == {2}  # joined where it was measured
        # status over every instance: each layer's 30 traces, its reference of 30 ready (all 30 taught it:
        # none was judged by it, "-")
        assert [row[3:7] for row in got["status"]] == [["-", "30/30", "ready", "30"]] * HEALTHY.layers, \
            got["status"]
    # the collapse found on both (which other kinds cross too may differ: the judge reads the traces of
    # three instances in another order, and a reference's calibration folds follow its order)
    assert "entropy_collapse" in one["kinds"] and "entropy_collapse" in three["kinds"], (one, three)
    assert sum(v > 0 for v in three["measured"]) >= 2, three["measured"]  # measured on several instances...
    assert sum(v > 0 for v in three["judged"]) == 1, three["judged"]  # ...and judged on one


def test_an_instance_without_the_internal_topics_refuses_to_start_and_names_them(kafka_broker, make_topic,
                                                                                    tmp_path):
    """Every instance judges through the observations and judge-state topics: one that
    cannot find them stops at once (exit 3), naming both and the command that creates
    them, instead of measuring traces no judge will ever see."""
    topics = make_topics(make_topic, partitions=2)
    publish_contracts(kafka_broker.bootstrap, topics, [HEALTHY.contract()])
    env = monitor_env(kafka_broker.bootstrap, topics, f"no-internal-{tmp_path.name}", tmp_path,
                      measure_processes=0, observations_topic=f"missing-observations-{tmp_path.name}",
                      judge_state_topic=f"missing-judge-state-{tmp_path.name}")
    monitor = Monitor(env, tmp_path / "monitor.log")
    try:
        wait_for(lambda: not monitor.process.alive(), timeout=90, what="the instance to refuse")
        log = monitor.process.log_path.read_text()
        assert monitor.process.proc.returncode == 3, log[-2000:]
        assert (f"topics missing-observations-{tmp_path.name} and missing-judge-state-{tmp_path.name} missing"
                in log), log[-2000:]
        assert "attention-monitor topics create --partitions 2" in log
    finally:
        monitor.process.stop()


def test_an_instance_on_a_broker_without_its_topics_names_every_one_and_the_command(kafka_broker, tmp_path):
    """A first start against a fresh broker: one refusal naming every missing topic and
    how to create them, not the first one alone."""
    topics = Topics(**{field.name: f"absent-{field.name}-{tmp_path.name}" for field in fields(Topics)})
    env = monitor_env(kafka_broker.bootstrap, topics, f"fresh-{tmp_path.name}", tmp_path, measure_processes=0)
    monitor = Monitor(env, tmp_path / "monitor.log")
    try:
        wait_for(lambda: not monitor.process.alive(), timeout=90, what="the instance to refuse")
        log = monitor.process.log_path.read_text()
        assert monitor.process.proc.returncode == 3, log[-2000:]
        refusal = next(line for line in log.splitlines() if "missing or not describable" in line)
        assert all(name in refusal for name in vars(topics).values()), refusal
        assert "`attention-monitor topics create --partitions N` (N: at most this many instances" in refusal
        assert "measuring in" not in log, log  # refused before measuring started
    finally:
        monitor.process.stop()


def test_a_deployment_still_setting_judging_is_told_what_changed():
    import subprocess
    import sys

    from tests.service.harness import REPO

    env = {"PATH": "/usr/bin:/bin", "ATTENTION_MONITOR_JUDGING": "instance"}
    done = subprocess.run([sys.executable, "-m", "monitor", "check-config"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    assert "ATTENTION_MONITOR_JUDGING (here 'instance') was removed" in done.stderr, done.stderr
    assert "judged in one place whatever the number of instances" in done.stderr
