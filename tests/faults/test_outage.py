"""The broker down longer than the output producer's delivery timeout, with a batch in
the monitor's hands: /readyz says 503 while it cannot commit, the failed transaction is
counted and sent again, and when the broker is back every record is in the outputs
exactly once (the first release lost 242 dead letters this way, silently), and traces
sent after it are consumed."""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request

import pytest
from kafka import KafkaAdminClient

from devstack.kafka import start_broker
from devstack.wait import wait_for
from monitor.protocol.codec import encode
from tests.conftest import _topic_factory
from tests.factories import KEY_ID, SECRET
from tests.faults.accounting import one_dead_letter_each, one_output_each, processed
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
)
from tests.service.test_delivery import poison
from tests.service.test_service import collapsed, healthy

pytestmark = [pytest.mark.kafka, pytest.mark.faults]
DELIVERY_TIMEOUT_S = 4
OUTAGE_S = 20


def readyz(monitor: Monitor) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor.port}/readyz", timeout=3) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_an_outage_longer_than_the_delivery_timeout_loses_and_doubles_nothing(tmp_path):
    broker = start_broker("plaintext", tmp_path / "kafka")
    admin = KafkaAdminClient(**broker.client_config())
    factory = _topic_factory(admin, lambda kind: f"{kind}-outage-{time.time_ns()}")
    monitor = None
    try:
        topics = make_topics(next(factory))
        publish_contracts(broker.bootstrap, topics)
        # batches_in_flight: while its measuring process is held below, the service keeps
        # polling (every poll, empty or not, is a batch in flight) until the whole batch
        # is in its hands, however the broker splits it over polls
        env = monitor_env(broker.bootstrap, topics, f"outage-{time.time_ns()}", tmp_path,
                          delivery_timeout_ms=DELIVERY_TIMEOUT_S * 1000, measure_processes=1, batches_in_flight=1000)
        monitor = Monitor(env, tmp_path / "monitor.log")
        monitor.wait_ready()
        reference = healthy(40, 0)
        send_traces(broker.bootstrap, topics.traces, reference)
        monitor.wait_until(lambda: monitor.value("attention_monitor_observations_judged_total") >= 40, timeout=60,
                           what="the reference learnt (its traces judged once their join's wait is over)")

        # A batch in the monitor's hands when the broker goes: its measuring process is
        # held while the service polls the batch, then released into the outage.
        bad, junk = collapsed(12, 0), poison(6)
        send_outcomes(broker.bootstrap, topics.outcomes, {h.request_id: "failure" for h, _ in bad})
        wait_for(lambda: monitor.value("attention_monitor_outcomes_consumed_total") >= 12, timeout=30,
                 what="the outcomes waiting in the join")
        (child,) = measuring_processes(monitor)
        os.kill(child, signal.SIGSTOP)
        polled_before = monitor.value("attention_monitor_records_polled_total")
        send_raw(broker.bootstrap, topics.traces, [(h.request_id.encode(), encode(h, w, KEY_ID, SECRET))
                                                   for h, w in bad] + junk)  # one flush: one or two polls
        wait_for(lambda: monitor.value("attention_monitor_records_polled_total") >= polled_before + 18,
                 timeout=30, what="the batch polled by the service")
        broker.kill()
        down_at = time.monotonic()
        os.kill(child, signal.SIGCONT)

        monitor.wait_until(lambda: readyz(monitor) == 503, timeout=30, what="/readyz saying 503 in the outage")
        failed = ("attention_monitor_output_failures_total{reason=aborted}",
                  "attention_monitor_output_failures_total{reason=stalled}")
        monitor.wait_until(lambda: sum(monitor.value(name) for name in failed) >= 1, timeout=DELIVERY_TIMEOUT_S * 6,
                           what="the failing transaction counted")
        assert monitor.value("attention_monitor_commits_total") >= 1  # the reference's batches, before
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))  # the outage itself: a fixed duration
        assert readyz(monitor) == 503 and monitor.process.alive()
        broker.restart()

        monitor.wait_until(lambda: readyz(monitor) == 200, timeout=60, what="ready again after the outage")
        reader = OutputReader(broker.bootstrap, topics.anomalies, topics.dead_letter)
        reader.wait(lambda r: {a.get("trace_id") for a in r[topics.anomalies]} >= {h.trace_id for h, _ in bad}
                    and len(r[topics.dead_letter]) >= 6, timeout=60, what="every output after the outage")
        reader.settle(quiet=3)
        reader.close()
        with monitor.explaining(lines=80):
            one_output_each(reader.records[topics.anomalies], {h.trace_id for h, _ in bad})
            one_dead_letter_each(reader.records[topics.dead_letter], 6)
        assert all(a["outcome"] == "failure" for a in reader.records[topics.anomalies] if a.get("kind"))
        # and it still consumes: a client that failed for good in the outage (a static
        # member's session expires while the broker is away) would now fetch nothing
        after = healthy(10, 0, start=700)
        send_traces(broker.bootstrap, topics.traces, after)
        produced = len(reference) + len(bad) + len(junk) + len(after)
        monitor.wait_until(lambda: processed(monitor.metrics()) >= produced, timeout=60,
                           what="the traces sent after the outage consumed")
        assert processed(monitor.metrics()) == produced  # one process: every record exactly once
    finally:
        if monitor is not None:
            monitor.process.stop()
        next(factory, None)
        admin.close()
        broker.stop()
