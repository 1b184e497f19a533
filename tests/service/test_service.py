"""The monitor service against the real broker: anomaly records, metrics, joins in
either order, poison records, SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest
from kafka import KafkaAdminClient
from typer.testing import CliRunner

from devstack.wait import wait_for
from monitor.cli import app
from monitor.tools.synthetic import SyntheticModel, layer_roles, make_header, sample_positions, trace_weights
from tests.factories import make_record, make_trace
from tests.service.harness import (
    Monitor,
    OutputReader,
    make_topics,
    measuring_processes,
    monitor_env,
    publish_contracts,
    send_outcomes,
    send_raw,
    send_traces,
    series,
)

pytestmark = pytest.mark.kafka


def healthy(n, layer, start=0, **fields):
    return [make_trace(1000 + start + i, layer=layer, keys=64, rows=6, **fields) for i in range(n)]


def collapsed(n, layer, start=0, **fields):
    """``fields``: ``contract`` (another revision), header fields."""
    return [make_trace(5000 + start + i, layer=layer, keys=64, rows=6, collapse=0.95, **fields) for i in range(n)]


@pytest.fixture
def stack(kafka_broker, make_topic, unique_name, tmp_path):
    topics = make_topics(make_topic)
    publish_contracts(kafka_broker.bootstrap, topics)
    env = monitor_env(kafka_broker.bootstrap, topics, unique_name("group"), tmp_path)
    started = []

    def start(name="monitor", **overrides):
        merged = {**env, **{f"ATTENTION_MONITOR_{k.upper()}": str(v) for k, v in overrides.items()}}
        monitor = Monitor(merged, tmp_path / f"{name}.log", name)
        started.append(monitor)
        monitor.wait_ready()
        return monitor

    reader = OutputReader(kafka_broker.bootstrap, topics.anomalies, topics.dead_letter)
    yield topics, start, reader
    reader.close()
    for monitor in started:
        monitor.process.stop()


def test_anomalies_outcomes_joins_poison_and_metrics(kafka_broker, stack, tmp_path):
    topics, start, reader = stack
    bootstrap = kafka_broker.bootstrap
    monitor = start()

    reference = healthy(40, 0) + healthy(40, 1)
    send_traces(bootstrap, topics.traces, reference)
    send_outcomes(bootstrap, topics.outcomes, {h.request_id: "success" for h, _ in reference})
    wait_for(lambda: monitor.value("attention_monitor_traces_consumed_total") >= 80, timeout=60,
             what="reference traces consumed")

    # 21 collapsed traces: the page threshold of a 30-trace reference allows for its estimation error (twice an
    # exact reference's), so the collapse pages on about its 15th trace and opens the incident shown below
    early, late, silent = collapsed(10, 1), collapsed(10, 1, start=100), collapsed(1, 1, start=200)
    send_outcomes(bootstrap, topics.outcomes, {h.request_id: "failure" for h, _ in early})  # outcome first
    wait_for(lambda: monitor.value("attention_monitor_outcomes_consumed_total") >= 90, timeout=30,
             what="early outcomes consumed")
    send_traces(bootstrap, topics.traces, early + late + silent)
    send_raw(bootstrap, topics.traces, [(b"poison-1", b"\x00garbage"), (b"poison-2", make_record(9)[:-1] + b"\x00")])
    wait_for(lambda: monitor.value("attention_monitor_traces_consumed_total") >= 103, timeout=30,
             what="collapsed traces consumed")
    send_outcomes(bootstrap, topics.outcomes, {h.request_id: "failure" for h, _ in late})  # trace first

    collapsed_ids = {h.trace_id: h.request_id for h, _ in early + late + silent}
    records = reader.wait(lambda r: {a["trace_id"] for a in r[topics.anomalies] if a.get("kind") == "low_diversity"}
                          >= {h.trace_id for h, _ in early + late + silent} and len(r[topics.dead_letter]) >= 2,
                          timeout=60, what="low-diversity records for every collapsed trace, and two dead letters")
    reader.settle()
    low = [a for a in reader.records[topics.anomalies] if a.get("kind") == "low_diversity"]
    assert all(a["trace_id"] in collapsed_ids and a["layer"] == 1 for a in low)
    by_trace = {a["trace_id"]: a for a in low}
    assert len(by_trace) == len(low), "an anomaly record was written twice"
    for header, _ in early + late:
        assert by_trace[header.trace_id]["outcome"] == "failure"
    assert by_trace[silent[0][0].trace_id]["outcome"] == "pending"  # after the 5 s join TTL: it may come late
    record = low[0]
    assert record["model_id"] == "test-model" and record["model_revision"] == "rev-1"
    assert record["contract_id"].startswith("attention-model-contract@sha256:")
    assert record["value"] < record["reference"] and record["score"] > 0 and record["heads"]
    assert "pruning" in record["policy"]["alerts"] and "ablation" in record["policy"]["specialization"]
    assert "weights" not in record
    reasons = sorted(d["reason"] for d in records[topics.dead_letter])
    assert reasons == ["bad_signature", "malformed"]

    m = monitor.metrics()
    # Records read = distinct traces + re-deliveries caught by the trace-id window.
    assert m["attention_monitor_traces_consumed_total"] - m["attention_monitor_duplicates_total"] == 103, m
    assert m["attention_monitor_traces_rejected_total{reason=malformed}"] == 1
    assert m["attention_monitor_traces_rejected_total{reason=bad_signature}"] == 1
    layer1 = {"model": "test-model", "revision": "rev-1", "layer": 1}
    assert m[series("attention_traces_total", **layer1)] == 61
    assert m[series("attention_anomalies_total", kind="low_diversity", **layer1)] == len(low)
    assert m[series("attention_anomaly_outcomes_total", kind="low_diversity", outcome="failure", **layer1)] == 20
    assert m[series("attention_anomaly_outcomes_total", kind="low_diversity", outcome="missing", **layer1)] == 0
    assert m[series("attention_trace_outcomes_pending", **layer1)] == 1  # the silent one, for OUTCOME_WINDOW_S
    assert m[series("attention_trace_outcomes_total", outcome="success", **layer1)] == 40
    assert m[series("attention_layer_diversity_count", **layer1)] == 61
    assert m["attention_monitor_last_trace_timestamp_seconds"] > 1.7e9

    # On-call's view of the same records.
    result = CliRunner().invoke(app, ["triage", "--layer", "1", "--kind", "low_diversity"], env={
        "ATTENTION_MONITOR_BOOTSTRAP_SERVERS": bootstrap, "ATTENTION_MONITOR_ANOMALIES_TOPIC": topics.anomalies})
    assert result.exit_code == 0, result.output
    assert f"test-model rev-1 layer 1 low_diversity: {len(low)} records" in result.output
    assert "outcomes: failure=20, pending=1" in result.output
    assert "not an automatic pruning command" in result.output

    # One incident, as text and as its page: the same findings, traces and heads.
    env = {"ATTENTION_MONITOR_BOOTSTRAP_SERVERS": bootstrap, "ATTENTION_MONITOR_ANOMALIES_TOPIC": topics.anomalies}
    incident = next(r for r in reader.records[topics.anomalies] if r.get("schema", "").startswith("attention-incident"))
    text = CliRunner().invoke(app, ["triage", "--incident", incident["incident_id"]], env=env)
    assert text.exit_code == 0, text.output
    assert text.output.count("findings on") == 1 and incident["incident_id"] in text.output
    shown = re.search(r"(\d+) findings on (\d+) traces .*\n\s+heads involved: (.*) \(traces whose", text.output)
    assert shown, text.output
    page_path = tmp_path / "incident.html"
    html = CliRunner().invoke(app, ["triage", "--incident", incident["incident_id"], "--html", str(page_path)], env=env)
    assert html.exit_code == 0, html.output
    page = page_path.read_text()
    field = {name: re.search(rf'data-field="{name}">(\d+)<', page)[1] for name in ("anomalies", "traces")}
    assert (shown[1], shown[2]) == (field["anomalies"], field["traces"])
    assert [h.split(" (")[0] for h in shown[3].split(", ")] == re.findall(r'<span data-head="([^"]+)"', page)
    unknown = CliRunner().invoke(app, ["triage", "--incident", "no-such-incident"], env=env)
    assert unknown.exit_code == 2 and "no incident 'no-such-incident'" in unknown.output


def test_a_poison_record_does_not_stall_its_partition(kafka_broker, stack, make_topic):
    topics, start, reader = stack
    monitor = start()
    traces = healthy(5, 0)
    # The same key sends poison and valid records to the same partition, poison first.
    key = traces[0][0].request_id.encode()
    send_raw(kafka_broker.bootstrap, topics.traces, [(key, b"ATRC\x01\x00\x00\xff\xff\xff\xff"), (key, b"")])
    send_traces(kafka_broker.bootstrap, topics.traces, traces)
    processed = series("attention_traces_total", layer=0, model="test-model", revision="rev-1")
    wait_for(lambda: monitor.value(processed) == 5, timeout=30, what="the valid traces behind the poison processed")
    reader.wait(lambda r: len(r[topics.dead_letter]) == 2, timeout=20, what="both poison records dead-lettered")


@pytest.mark.parametrize("processes", [1, 2, 0], ids=["measuring-process", "measuring-processes-2", "measuring-thread"])
def test_sigterm_finishes_flushes_commits_and_exits_zero(kafka_broker, stack, processes):
    topics, start, _ = stack
    monitor = start(measure_processes=processes)
    assert len(measuring_processes(monitor)) == processes
    # Offsets are held back while a trace waits for its outcome; once all have joined,
    # everything read is committable.
    send_joined(kafka_broker.bootstrap, topics, monitor, 20)
    monitor.process.proc.send_signal(signal.SIGTERM)
    assert monitor.process.proc.wait(30) == 0
    assert committed_traces(kafka_broker.bootstrap, monitor, topics.traces) == 20
    assert reference_counts(monitor) == [20]  # the stage's state, saved on the way out
    log = monitor.process.log_path.read_text(errors="replace")
    assert "garbage collector: " in log and "objects made while starting frozen" in log
    assert ("MEASURE_PROCESSES=0 measures in a thread" in log) == (processes == 0)
    # A restart starts from the saved references and learns on from there.
    again = start(f"monitor-again-{processes}", measure_processes=processes)
    more = healthy(10, 0, start=20)  # joined to their outcomes: a trace is judged once joined
    send_traces(kafka_broker.bootstrap, topics.traces, more)
    send_outcomes(kafka_broker.bootstrap, topics.outcomes, {h.request_id: "success" for h, _ in more})
    joined = series("attention_trace_outcomes_total", layer=0, model="test-model", outcome="success",
                    revision="rev-1")
    wait_for(lambda: again.value(joined) == 10, timeout=30, what="10 more traces joined after the restart")
    again.process.proc.send_signal(signal.SIGTERM)
    assert again.process.proc.wait(30) == 0
    assert reference_counts(again) == [30]


@pytest.mark.parametrize("interval_ms", [0, 600_000])
def test_batches_finished_within_the_commit_interval_share_one_transaction(kafka_broker, stack, interval_ms):
    topics, start, _ = stack
    monitor = start(commit_interval_ms=interval_ms, batch_max_records=2)  # many small batches
    send_joined(kafka_broker.bootstrap, topics, monitor, 12)
    commits = monitor.value("attention_monitor_commits_total")
    if interval_ms:
        assert commits <= 1  # the first finished batch commits at once, the others wait for the interval
    else:
        wait_for(lambda: monitor.value("attention_monitor_commits_total") >= 2, timeout=10,
                 what="a transaction for each batch that finished apart")
    monitor.process.proc.send_signal(signal.SIGTERM)
    assert monitor.process.proc.wait(30) == 0  # the batches still waiting are committed on the way out
    assert committed_traces(kafka_broker.bootstrap, monitor, topics.traces) == 12
    assert "committing finished batches together at most every" in monitor.process.log_path.read_text()


def send_joined(bootstrap: str, topics, monitor: Monitor, n: int) -> None:
    """Send ``n`` healthy layer-0 traces with a successful outcome each; wait until all joined."""
    traces = healthy(n, 0)
    send_traces(bootstrap, topics.traces, traces)
    send_outcomes(bootstrap, topics.outcomes, {h.request_id: "success" for h, _ in traces})
    joined = series("attention_trace_outcomes_total", layer=0, model="test-model", outcome="success",
                    revision="rev-1")
    wait_for(lambda: monitor.value(joined) == n, timeout=30, what=f"all {n} traces joined to their outcome")


def committed_traces(bootstrap: str, monitor: Monitor, topic: str) -> int:
    """The offsets the monitor's group committed on ``topic``, summed over its partitions."""
    group = monitor.env["ATTENTION_MONITOR_GROUP_ID"]
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        committed = admin.list_group_offsets(group)[group]
    finally:
        admin.close()
    return sum(meta.offset for tp, meta in committed.items() if tp.topic == topic)


def reference_counts(monitor: Monitor) -> list[int]:
    """Traces behind each saved reference (the state file of the monitor's group)."""
    files = list(Path(monitor.env["ATTENTION_MONITOR_STATE_DIR"]).glob("reference-*.json"))
    assert len(files) == 1, files
    doc = json.loads(files[0].read_text())
    return [int(item["reference"]["traces"]) for item in doc["references"]]


def test_a_dead_measuring_process_stops_the_monitor_with_exit_code_4(kafka_broker, stack):
    _, start, _ = stack
    monitor = start()
    measuring = measuring_processes(monitor)
    assert measuring
    os.kill(measuring[-1], signal.SIGKILL)  # any one of them
    assert monitor.process.proc.wait(30) == 4
    assert "the measuring process died" in monitor.process.log_path.read_text()


def test_a_contract_published_while_running_reaches_the_measuring_process(kafka_broker, stack):
    topics, start, _ = stack
    monitor = start()
    revision = SyntheticModel("test-model", "rev-2", layers=2, heads=4, kv_groups=2)
    contract = revision.contract()
    publish_contracts(kafka_broker.bootstrap, topics, [contract])
    wait_for(lambda: monitor.value("attention_monitor_contracts") == 2, timeout=30, what="the new contract loaded")
    rng = np.random.default_rng(3)
    traces = []
    for _ in range(5):
        positions = sample_positions(rng, 64, 6)
        header = make_header(contract, 0, positions, 64)
        traces.append((header, trace_weights(rng, layer_roles(0, 4), positions, 64)))
    send_traces(kafka_broker.bootstrap, topics.traces, traces)
    measured = series("attention_traces_total", layer=0, model="test-model", revision="rev-2")
    monitor.wait_until(lambda: monitor.value(measured) == 5, timeout=30, what="the new revision's traces measured")
    unknown = series("attention_monitor_traces_rejected_total", reason="unknown_contract")
    assert monitor.value(unknown) == 0
