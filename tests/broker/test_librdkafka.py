"""The service's clients on librdkafka (KAFKA_CLIENT=confluent-kafka) against the real
broker: a commit for a group generation that has moved on is refused (KIP-447), the
member rejoins and commits under its new one; a second producer with the same
transactional id fences the first; the connection settings reach librdkafka."""

from __future__ import annotations

import threading
import time

import pytest
from kafka import KafkaConsumer

from monitor.broker.librdkafka import librdkafka_config
from monitor.broker.outputs import GroupMovedOn
from monitor.broker.rd_group import RdGroupConsumer
from monitor.broker.rd_outputs import RdOutputProducer
from monitor.errors import InfrastructureError
from monitor.records import Output


def test_connection_settings_in_librdkafka_words():
    assert librdkafka_config({"bootstrap_servers": ["a:9092", "b:9092"], "security_protocol": "SASL_PLAINTEXT",
                              "client_id": "m", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "u",
                              "sasl_plain_password": "p"}) == {
        "bootstrap.servers": "a:9092,b:9092", "security.protocol": "SASL_PLAINTEXT", "client.id": "m",
        "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "u", "sasl.password": "p"}
    with pytest.raises(KeyError):  # a setting nobody translated is a mistake, not something to drop
        librdkafka_config({"bootstrap_servers": "a:9092", "ssl_cafile": "/ca.pem"})


def member(bootstrap, group, topic):
    return RdGroupConsumer({"bootstrap_servers": bootstrap}, group, [topic], max_records=10,
                           max_partition_fetch_bytes=1 << 20, session_timeout_ms=6_000, heartbeat_interval_ms=500)


def read_committed(bootstrap, topic):
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, isolation_level="read_committed",
                             auto_offset_reset="earliest", consumer_timeout_ms=2_000)
    try:
        return [r.value for r in consumer]
    finally:
        consumer.close()


@pytest.mark.kafka
def test_a_commit_for_a_generation_the_group_left_is_refused_and_the_rejoined_member_commits(
        kafka_broker, make_topic, unique_name):
    bootstrap = kafka_broker.bootstrap
    topic, out, group = make_topic("traces", partitions=2), make_topic("outputs"), unique_name("group")
    failures: list[str] = []
    producer = RdOutputProducer({"bootstrap_servers": bootstrap}, unique_name("txn"), delivery_timeout_ms=10_000,
                                on_failure=failures.append)
    a, b = member(bootstrap, group, topic), member(bootstrap, group, topic)
    stop = threading.Event()
    try:
        a.subscribe()
        deadline = time.monotonic() + 60
        while a.assignment() != {(topic, 0), (topic, 1)}:
            assert time.monotonic() < deadline, "the first member never got both partitions"
            a.poll(200)
        stale = a.group_metadata()
        b.subscribe()  # the second member joins: a rebalance, driven by its polls here
        joining = threading.Thread(target=lambda: [b.poll(200) for _ in iter(stop.is_set, True)], daemon=True)
        joining.start()
        kept = a.rejoin(60)
        assert kept is not None and len(kept) == 1, kept

        with pytest.raises(GroupMovedOn):
            producer.commit([Output(out, b"k", b"stale", (topic, 0, 0))], dict.fromkeys(kept, 5), stale)
        assert failures == ["group_moved"]
        producer.commit([Output(out, b"k", b"current", (topic, 0, 0))], dict.fromkeys(kept, 5), a.group_metadata())
        assert a.committed(kept) == dict.fromkeys(kept, 5)
        assert read_committed(bootstrap, out) == [b"current"]  # the refused transaction's output was aborted
    finally:
        stop.set()
        producer.close()
        a.close()
        b.close()


@pytest.mark.kafka
def test_a_second_producer_with_the_same_transactional_id_fences_the_first(kafka_broker, make_topic, unique_name):
    bootstrap, out, txn = kafka_broker.bootstrap, make_topic("outputs"), unique_name("txn")
    failures: list[str] = []
    first = RdOutputProducer({"bootstrap_servers": bootstrap}, txn, delivery_timeout_ms=10_000,
                             on_failure=failures.append)
    second = RdOutputProducer({"bootstrap_servers": bootstrap}, txn, delivery_timeout_ms=10_000)
    try:
        with pytest.raises(InfrastructureError, match="same transactional id took over") as raised:
            first.commit([Output(out, b"k", b"fenced", (out, 0, 0))], {}, None)
        assert not raised.value.retriable and failures == ["fenced"]
        second.commit([Output(out, b"k", b"taken over", (out, 0, 0))], {}, None)
        assert read_committed(bootstrap, out) == [b"taken over"]
    finally:
        first.close()
        second.close()
