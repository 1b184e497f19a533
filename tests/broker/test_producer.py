"""The producer class through the real broker."""

from __future__ import annotations

import time

import numpy as np
import pytest
from kafka import KafkaConsumer

from monitor.producer import TraceProducer
from monitor.topics import Topics
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
