"""Delivery on the real broker: kill -9 and restart, two instances and a rebalance.
Every trace ends up in the outputs exactly once."""

from __future__ import annotations

from collections import Counter

import pytest

from devstack.process import free_port
from devstack.wait import wait_for
from monitor.protocol.codec import encode
from tests.factories import make_trace
from tests.service.harness import (
    Monitor,
    OutputReader,
    make_topics,
    monitor_env,
    publish_contracts,
    send_outcomes,
    send_raw,
    send_traces,
    series,
)
from tests.service.test_service import collapsed, healthy

pytestmark = pytest.mark.kafka


def poison(n, start=0):
    """Records signed with a key the monitor does not know (one dead letter each)."""
    out = []
    for i in range(n):
        header, weights = make_trace(9000 + start + i, keys=16, rows=2)
        out.append((header.request_id.encode(), encode(header, weights, "stranger", b"s" * 32)))
    return out


def low_diversity_counts(records, topic):
    return Counter(a["trace_id"] for a in records[topic] if a.get("kind") == "low_diversity")


@pytest.fixture
def setup(kafka_broker, make_topic, unique_name, tmp_path):
    def make(partitions, **overrides):
        topics = make_topics(make_topic, partitions=partitions)
        publish_contracts(kafka_broker.bootstrap, topics)
        env = monitor_env(kafka_broker.bootstrap, topics, unique_name("group"), tmp_path, **overrides)
        return topics, env
    return make


def test_kill_9_mid_stream_and_restart_counts_every_trace_once(kafka_broker, setup, tmp_path):
    bootstrap = kafka_broker.bootstrap
    topics, env = setup(partitions=2)
    reader = OutputReader(bootstrap, topics.anomalies, topics.dead_letter)
    first = Monitor(env, tmp_path / "first.log", "first")
    second = None
    try:
        first.wait_ready()
        reference = healthy(40, 0)
        send_traces(bootstrap, topics.traces, reference)
        send_outcomes(bootstrap, topics.outcomes, {h.request_id: "success" for h, _ in reference})
        wait_for(lambda: first.value("attention_monitor_traces_consumed_total") >= 40, timeout=60,
                 what="reference learnt")

        bad = collapsed(60, 0)
        send_outcomes(bootstrap, topics.outcomes, {h.request_id: "failure" for h, _ in bad})
        junk = poison(20)
        send_traces(bootstrap, topics.traces, bad[:30])
        send_raw(bootstrap, topics.traces, junk[:10])
        wait_for(lambda: first.value("attention_monitor_traces_consumed_total") >= 60, timeout=60,
                 what="the first monitor half-way through the stream")
        first.process.kill()  # kill -9: no flush, no commit, no goodbye

        send_traces(bootstrap, topics.traces, bad[30:])
        send_raw(bootstrap, topics.traces, junk[10:])
        second = Monitor(env, tmp_path / "second.log", "second")
        second.wait_ready(timeout=90)
        want = {h.trace_id for h, _ in bad}
        reader.wait(lambda r: set(low_diversity_counts(r, topics.anomalies)) >= want
                    and len(r[topics.dead_letter]) >= 20, timeout=90,
                    what="every collapsed trace and every poison record in the outputs")
        reader.settle(quiet=3)
    finally:
        reader.close()
        if second is not None:
            second.process.stop()
        first.process.stop()

    counts = low_diversity_counts(reader.records, topics.anomalies)
    assert set(counts) == {h.trace_id for h, _ in bad}
    assert set(counts.values()) == {1}, {t: n for t, n in counts.items() if n != 1}
    assert all(a["outcome"] == "failure" for a in reader.records[topics.anomalies] if a.get("kind") == "low_diversity")
    sources = Counter((d["source"]["partition"], d["source"]["offset"]) for d in reader.records[topics.dead_letter])
    assert len(sources) == 20 and set(sources.values()) == {1}
    assert {d["reason"] for d in reader.records[topics.dead_letter]} == {"unknown_key"}


def test_two_instances_share_partitions_through_a_rebalance_without_double_counting(kafka_broker, setup, tmp_path):
    bootstrap = kafka_broker.bootstrap
    topics, env = setup(partitions=4)
    reader = OutputReader(bootstrap, topics.anomalies, topics.dead_letter)
    a = Monitor({**env, "ATTENTION_MONITOR_CLIENT_ID": "a"}, tmp_path / "a.log", "a")
    b = None
    try:
        a.wait_ready()
        first = healthy(150, 0)
        send_traces(bootstrap, topics.traces, first)
        send_outcomes(bootstrap, topics.outcomes, {h.request_id: "success" for h, _ in first})
        wait_for(lambda: a.value("attention_monitor_traces_consumed_total") >= 60, timeout=60,
                 what="the first instance under way")
        b = Monitor({**env, "ATTENTION_MONITOR_CLIENT_ID": "b", "ATTENTION_MONITOR_METRICS_PORT": str(free_port())},
                    tmp_path / "b.log", "b")  # joining the group: a rebalance
        b.wait_ready(timeout=90)
        wait_for(lambda: b.value("attention_monitor_rebalances_total") >= 1, timeout=60,
                 what="the second instance receiving partitions")
        more = healthy(150, 0, start=500)
        send_traces(bootstrap, topics.traces, more)
        send_outcomes(bootstrap, topics.outcomes, {h.request_id: "success" for h, _ in more})

        def processed():
            return a.value("attention_traces_total{layer=0,model=test-model,revision=rev-1}") + \
                b.value("attention_traces_total{layer=0,model=test-model,revision=rev-1}")

        wait_for(lambda: processed() >= 300, timeout=90, what="all 300 traces processed by the pair")
        # Both hold partitions, and nothing was counted twice across the rebalance.
        assert a.value("attention_monitor_rebalances_total") >= 2  # its first assignment, then b's arrival
        assert b.value("attention_traces_total{layer=0,model=test-model,revision=rev-1}") > 0
        assert a.process.alive() and b.process.alive()
        reader.settle(quiet=3)
        assert processed() == 300
        # Traces and outcomes share partition numbers, so every trace met its outcome in
        # whichever instance owns that partition: no 'missing' after the join TTL.
        def joined(outcome):
            name = series("attention_trace_outcomes_total", layer=0, model="test-model", outcome=outcome,
                          revision="rev-1")
            return a.value(name) + b.value(name)

        wait_for(lambda: joined("success") == 300, timeout=30, what="all 300 traces joined to their outcome")
        assert joined("missing") == 0
        assert not reader.records[topics.dead_letter]
    finally:
        reader.close()
        if b is not None:
            b.process.stop()
        a.process.stop()


def test_an_instance_given_no_partition_stands_by_ready_and_takes_the_work_when_the_other_leaves(
        kafka_broker, setup, tmp_path):
    """More instances than partitions: the one given none is ready (it was 503, "no
    partition assignment yet", for as long as it stood by), and when the other leaves it
    takes the partitions over and processes what follows."""
    bootstrap = kafka_broker.bootstrap
    topics, env = setup(partitions=1)
    a = Monitor({**env, "ATTENTION_MONITOR_CLIENT_ID": "a"}, tmp_path / "a.log", "a")
    b = None
    try:
        a.wait_ready()
        b = Monitor({**env, "ATTENTION_MONITOR_CLIENT_ID": "b", "ATTENTION_MONITOR_METRICS_PORT": str(free_port())},
                    tmp_path / "b.log", "b")
        b.wait_ready(timeout=90)
        wait_for(lambda: a.value("attention_monitor_rebalances_total") >= 2 and a.ready(), timeout=60,
                 what="the first instance ready again after the rebalance b's arrival made")
        traced = "attention_traces_total{layer=0,model=test-model,revision=rev-1}"
        first = healthy(20, 0)
        send_traces(bootstrap, topics.traces, first)
        send_outcomes(bootstrap, topics.outcomes, {h.request_id: "success" for h, _ in first})
        wait_for(lambda: a.value(traced) + b.value(traced) >= 20, timeout=60, what="the first 20 traces processed")
        working, standing_by = (a, b) if a.value(traced) else (b, a)
        assert standing_by.value(traced) == 0 and standing_by.ready()
        assert "assigned no partition" in standing_by.process.log_path.read_text()  # says why it is idle
        working.process.stop()
        more = healthy(20, 0, start=100)
        send_traces(bootstrap, topics.traces, more)
        send_outcomes(bootstrap, topics.outcomes, {h.request_id: "success" for h, _ in more})
        wait_for(lambda: standing_by.value(traced) >= 20, timeout=90,
                 what="the instance that stood by processing the traces sent after the other left")
    finally:
        if b is not None:
            b.process.stop()
        a.process.stop()
