"""The producer class through the real broker."""

from __future__ import annotations

import time

import numpy as np
import pytest
from kafka import KafkaConsumer

from monitor.producer import TaskOutcome, TraceProducer
from monitor.protocol.topics import Topics
from tests.factories import KEY_ID, SECRET, decode_default, make_trace

pytestmark = pytest.mark.kafka


def test_produce_consume_decode_round_trip(kafka_broker, make_topic, unique_name):
    topic = make_topic("traces", partitions=3)
    sent = [make_trace(seed, layer=seed % 2, keys=64, rows=4) for seed in range(12)]
    with TraceProducer(key_id=KEY_ID, secret=SECRET, topics=Topics(traces=topic),
                       bootstrap_servers=kafka_broker.bootstrap, compression_type="lz4") as producer:
        futures = [producer.send(header, weights) for header, weights in sent]
    assert all(f.get(timeout=10).topic == topic for f in futures)

    consumer = KafkaConsumer(topic, group_id=unique_name("group"), auto_offset_reset="earliest",
                             bootstrap_servers=kafka_broker.bootstrap, enable_auto_commit=False)
    received = {}
    deadline = time.monotonic() + 20
    try:
        while len(received) < len(sent) and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                for record in records:
                    trace = decode_default(record.value)
                    assert record.key == trace.header.request_id.encode()
                    received[trace.header.trace_id] = trace
    finally:
        consumer.close()
    assert len(received) == len(sent)
    for header, weights in sent:
        trace = received[header.trace_id]
        assert trace.header == header
        np.testing.assert_array_equal(trace.weights, weights)


def test_a_trace_id_is_sent_once_and_outcomes_say_success_or_failure_with_a_label_and_score(kafka_broker, make_topic):
    topics = Topics(traces=make_topic("traces"), outcomes=make_topic("outcomes"))
    header, weights = make_trace(0, layer=0)
    with TraceProducer(key_id=KEY_ID, secret=SECRET, topics=topics, bootstrap_servers=kafka_broker.bootstrap) as p:
        p.send(header, weights).get(timeout=10)
        # a request-level id reused for the next layer would be dropped by the monitor as a duplicate
        layer_1, weights_1 = make_trace(1, layer=1, request_id=header.request_id)
        with pytest.raises(ValueError, match="unique per request × layer"):
            p.send(layer_1.model_copy(update={"trace_id": header.trace_id}), weights_1)
        p.send(layer_1, weights_1).get(timeout=10)  # its own trace id: fine
        with pytest.raises(ValueError, match="outcome"):
            p.send_outcome(header.request_id, "ok")
        p.send_outcome(header.request_id, "failure", 12.5).get(timeout=10)  # as before labels: positional time
        with pytest.raises(ValueError, match="means failure"):
            p.send_outcome(header.request_id, "success", label="thumbs_down")
        with pytest.raises(ValueError, match="less than or equal to 1"):
            p.send_outcome(header.request_id, "failure", score=2.0)
        p.send_outcome(layer_1.request_id, label="regenerate", score=0.25, timestamp=13.0).get(timeout=10)
    consumer = KafkaConsumer(topics.outcomes, group_id=None, auto_offset_reset="earliest",
                             bootstrap_servers=kafka_broker.bootstrap, enable_auto_commit=False)
    try:
        records = [r for batch in consumer.poll(timeout_ms=5000).values() for r in batch]
    finally:
        consumer.close()
    assert [(r.key, TaskOutcome.model_validate_json(r.value)) for r in records] == [
        (header.request_id.encode(), TaskOutcome(request_id=header.request_id, outcome="failure", timestamp=12.5)),
        (header.request_id.encode(), TaskOutcome(request_id=header.request_id, outcome="failure", label="regenerate",
                                                 score=0.25, timestamp=13.0))]
    assert b'"outcome":"failure"' in records[1].value and b"null" not in records[1].value  # older monitors read it
