"""kill -9 while a reference is being learnt, and traces sent again after a restart.

The first release lost a reference learnt 12 s before a kill -9 (the next traffic, a
collapsed revision, became the reference: 0 of 60 flagged), and wrote a second anomaly
record for a trace sent again after a restart (5 of 5)."""

from __future__ import annotations

import random

import pytest

from tests.faults.accounting import one_output_each, processed
from tests.service.harness import (
    Monitor,
    OutputReader,
    make_topics,
    monitor_env,
    publish_contracts,
    send_outcomes,
    send_traces,
    series,
)
from tests.service.test_service import collapsed, healthy

pytestmark = [pytest.mark.kafka, pytest.mark.faults]


READY = series("attention_reference_ready", layer=0, model="test-model", revision="rev-1")


@pytest.fixture
def setup(kafka_broker, make_topic, unique_name, tmp_path):
    topics = make_topics(make_topic)
    publish_contracts(kafka_broker.bootstrap, topics)
    # the shipped state-save interval (30 s): durability must not depend on saving often
    env = monitor_env(kafka_broker.bootstrap, topics, unique_name("group"), tmp_path, state_save_interval_s=30)
    return topics, env


def test_kill_9_while_the_reference_is_learnt_keeps_it(kafka_broker, setup, tmp_path):
    topics, env = setup
    bootstrap = kafka_broker.bootstrap
    rng = random.Random(7)
    reference = healthy(30, 0)  # REFERENCE_TRACES is 30 in the harness
    sent = 0
    runs: list[dict[str, float]] = []
    for attempt in range(3):  # three kill -9s at random points of the learning
        monitor = Monitor(env, tmp_path / f"run-{attempt}.log", f"run-{attempt}")
        monitor.wait_ready()
        upto = min(len(reference), sent + rng.randint(6, 12))
        send_traces(bootstrap, topics.traces, reference[sent:upto])
        sent = upto
        monitor.wait_until(lambda m=monitor, n=sent: m.value("attention_monitor_commits_total") >= 1
                           and m.value("attention_monitor_records_polled_total") >= n - 12, timeout=60,
                           what="learning traces taken in")
        runs.append(monitor.metrics())
        monitor.process.kill()  # kill -9: no goodbye
    final = Monitor(env, tmp_path / "final.log", "final")
    reader = OutputReader(bootstrap, topics.anomalies)
    try:
        final.wait_ready()
        send_traces(bootstrap, topics.traces, reference[sent:])
        final.wait_until(lambda: final.value(READY) == 1, timeout=60, what="the reference ready")
        bad = collapsed(20, 0)  # after it: with two partitions, they could otherwise be read first and taught
        send_outcomes(bootstrap, topics.outcomes, {h.request_id: "failure" for h, _ in bad})
        send_traces(bootstrap, topics.traces, bad)
        reader.wait(lambda r: {a.get("trace_id") for a in r[topics.anomalies]} >= {h.trace_id for h, _ in bad},
                    timeout=60, what="every collapsed trace flagged against the reference the killed runs learnt")
        reader.settle(quiet=2)
        one_output_each(reader.records[topics.anomalies], {h.trace_id for h, _ in bad})
        final_metrics = final.metrics()
        produced = len(reference) + len(bad)
        # every record accounted for by some run (a killed run's uncommitted records are read again)
        assert sum(processed(m) for m in [*runs, final_metrics]) >= produced
        assert processed(final_metrics) >= len(bad)
    finally:
        reader.close()
        final.process.stop()


def test_a_trace_sent_again_after_a_restart_is_a_duplicate(kafka_broker, setup, tmp_path):
    topics, env = setup
    bootstrap = kafka_broker.bootstrap
    reference, bad = healthy(30, 0), collapsed(5, 0)
    first = Monitor(env, tmp_path / "first.log", "first")
    reader = OutputReader(bootstrap, topics.anomalies)
    try:
        first.wait_ready()
        send_traces(bootstrap, topics.traces, reference)
        first.wait_until(lambda: first.value(READY) == 1, timeout=60, what="the reference ready")
        send_traces(bootstrap, topics.traces, bad)
        reader.wait(lambda r: {a.get("trace_id") for a in r[topics.anomalies]} >= {h.trace_id for h, _ in bad},
                    timeout=60, what="the collapsed traces flagged")
        first.process.stop()
        second = Monitor(env, tmp_path / "second.log", "second")
        try:
            second.wait_ready()
            send_traces(bootstrap, topics.traces, bad)  # the same records again, at new offsets
            second.wait_until(lambda: second.value("attention_monitor_duplicates_total") == len(bad), timeout=60,
                              what="the re-sent traces recognised as duplicates")
            reader.settle(quiet=2)
            assert processed(second.metrics()) == len(bad)  # read once each, all of them duplicates
        finally:
            second.process.stop()
        one_output_each(reader.records[topics.anomalies], {h.trace_id for h, _ in bad})
    finally:
        reader.close()
        first.process.stop()
