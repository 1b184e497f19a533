"""A backlog that takes longer than the join TTL to drain: small outcome records are read
far ahead of the large traces, and the first release let 316 of 500 outcomes expire
before their traces came (every one said ``missing``). The join now runs on the records'
event times."""

from __future__ import annotations

import time

import pytest
from kafka import KafkaProducer

from monitor.protocol.codec import encode
from tests.factories import KEY_ID, SECRET, make_trace
from tests.faults.accounting import one_output_each, processed
from tests.service.harness import (
    Monitor,
    OutputReader,
    make_topics,
    monitor_env,
    publish_contracts,
    send_outcomes,
    send_traces,
)
from tests.service.test_service import healthy

pytestmark = [pytest.mark.kafka, pytest.mark.faults]
BACKLOG, TTL_S = 400, 0.5


def test_a_backlog_longer_than_the_join_ttl_joins_as_live_traffic(kafka_broker, make_topic, unique_name, tmp_path):
    bootstrap = kafka_broker.bootstrap
    topics = make_topics(make_topic, partitions=1)
    publish_contracts(bootstrap, topics)
    reference = healthy(30, 0)  # the reference, first in the partition and first joined (a trace is judged once
    send_traces(bootstrap, topics.traces, reference)  # joined: without outcomes it would wait for the TTL)
    send_outcomes(bootstrap, topics.outcomes, {h.request_id: "success" for h, _ in reference})
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, max_request_size=4 << 20)
    started = time.monotonic()
    traces = []
    for i in range(BACKLOG):  # trace then outcome, produced over ~4 s: eight join TTLs of event time
        header, weights = make_trace(7000 + i, keys=2048, rows=8, collapse=0.95)
        traces.append(header)
        producer.send(topics.traces, key=header.request_id.encode(), value=encode(header, weights, KEY_ID, SECRET))
        producer.send(topics.outcomes, key=header.request_id.encode(),
                      value=f'{{"request_id": "{header.request_id}", "outcome": "failure"}}'.encode())
        if i % 50 == 49:
            producer.flush()
            time.sleep(max(0.0, (i + 1) * 0.01 - (time.monotonic() - started)))
    producer.flush()
    producer.close()
    assert time.monotonic() - started > 4 * TTL_S

    env = monitor_env(bootstrap, topics, unique_name("group"), tmp_path, join_ttl_s=TTL_S)
    monitor = Monitor(env, tmp_path / "monitor.log")
    reader = OutputReader(bootstrap, topics.anomalies)
    try:
        monitor.wait_ready()
        reader.wait(lambda r: {a.get("trace_id") for a in r[topics.anomalies]} >= {h.trace_id for h in traces},
                    timeout=120, what="an anomaly record for every trace of the backlog")
        reader.settle(quiet=2)
        records = [a for a in reader.records[topics.anomalies] if a.get("kind") == "low_diversity"]
        one_output_each(records, {h.trace_id for h in traces})
        outcomes = {a["outcome"] for a in records}
        assert outcomes == {"failure"}, f"{sum(a['outcome'] == 'missing' for a in records)} of {len(records)} missing"
        assert processed(monitor.metrics()) == 30 + BACKLOG
    finally:
        reader.close()
        monitor.process.stop()
