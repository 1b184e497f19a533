"""The confluent-kafka readers against the real broker: a compacted table read in full and
kept up with, the committed tail of topics (aborted transactions never seen), offsets
asked on a connection of their own, and topics and ACLs administered."""

from __future__ import annotations

import json

import pytest
from kafka import KafkaProducer

from devstack.wait import wait_for
from monitor.broker.admin import CREATED, EXISTS, create_topics
from monitor.broker.connection import Connection
from monitor.broker.offsets import Offsets
from monitor.broker.tables import TableReader
from monitor.broker.tail import is_committed, read_tail
from monitor.errors import InfrastructureError
from monitor.protocol.topics import TopicSpec

pytestmark = pytest.mark.kafka


class Recorded:
    """A table that keeps every record it is given, refusing values of ``b"bad"``."""

    def __init__(self) -> None:
        self.applied: dict[bytes | None, bytes | None] = {}

    def apply(self, key: bytes | None, value: bytes | None) -> str | None:
        if value == b"bad":
            return None
        self.applied[key] = value
        return "ok"


def test_a_table_is_read_to_its_end_then_kept_up_with(kafka_broker, make_topic):
    topic = make_topic("table", partitions=3, configs={"cleanup.policy": "compact"})
    producer = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap)
    for i in range(30):
        producer.send(topic, key=f"k{i % 10}".encode(), value=f"v{i}".encode())
    producer.send(topic, key=b"refused", value=b"bad")
    producer.flush()
    table = Recorded()
    reader = TableReader(Connection(kafka_broker.bootstrap), topic, table)
    try:
        reader.load(30)
        assert table.applied == {f"k{i}".encode(): f"v{20 + i}".encode() for i in range(10)}
        producer.send(topic, key=b"k0", value=b"later").get(timeout=30)
        reader.load(30)  # to the end as of now: the record just written is in
        assert table.applied[b"k0"] == b"later"
    finally:
        reader.close()
        producer.close()


def test_a_missing_table_topic_is_a_clear_error(kafka_broker):
    with pytest.raises(InfrastructureError, match="does not exist") as raised:
        TableReader(Connection(kafka_broker.bootstrap), "no-such-topic-here", Recorded())
    assert not raised.value.retriable


def test_the_tail_holds_the_last_committed_records_and_no_aborted_one(kafka_broker, make_topic, unique_name):
    topic = make_topic("outputs", partitions=2)
    producer = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap, transactional_id=unique_name("txn"))
    producer.init_transactions()
    producer.begin_transaction()
    for i in range(12):
        producer.send(topic, partition=i % 2, value=json.dumps({"n": i}).encode())
    producer.send(topic, partition=0, value=b"not json")
    producer.commit_transaction()
    producer.begin_transaction()
    producer.send(topic, partition=1, value=json.dumps({"n": "aborted"}).encode())
    producer.flush()
    producer.abort_transaction()
    producer.close()
    connection = Connection(kafka_broker.bootstrap)
    docs = read_tail(connection, [topic], tail=5, timeout_s=30)
    # the last 5 offsets, markers included: partition 0 holds 0, 2, ..., 10, "not json" and a
    # commit marker; partition 1 holds 1, 3, ..., 11, a commit marker, the aborted record and
    # its abort marker
    assert sorted(d["n"] for d in docs) == [6, 8, 9, 10, 11]
    assert sorted(d["n"] for d in read_tail(connection, [topic], tail=100, timeout_s=30)) == list(range(12))
    assert read_tail(connection, ["no-such-topic-here"], tail=3, timeout_s=30) == []
    offsets = Offsets(connection)
    ends = offsets.end([(topic, 0), (topic, 1)], 10)
    assert offsets.end([(topic, 0), (topic, 1)], 10, committed=True) == ends  # no transaction left open
    assert offsets.beginning([(topic, 0), (topic, 1)], 10) == {(topic, 0): 0, (topic, 1): 0}
    assert ends[(topic, 0)] >= 8 and ends[(topic, 1)] >= 8  # records, markers included


def test_a_record_is_told_committed_once_its_transaction_ended_and_aborted_never(kafka_broker, make_topic,
                                                                                 unique_name):
    """What a transaction given up on without offsets is told by (service/delivery.py):
    its first record, read committed, once the partition's last stable offset passed it."""
    topic = make_topic("outputs")
    connection = Connection(kafka_broker.bootstrap)
    producer = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap, transactional_id=unique_name("txn"))
    other = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap, transactional_id=unique_name("txn"))
    try:
        producer.init_transactions()
        other.init_transactions()
        producer.begin_transaction()
        committed = producer.send(topic, partition=0, value=b"committed").get(timeout=30).offset
        producer.commit_transaction()
        producer.begin_transaction()
        aborted = producer.send(topic, partition=0, value=b"aborted").get(timeout=30).offset
        producer.abort_transaction()
        other.begin_transaction()  # an open transaction ahead of the next record holds its answer back
        other.send(topic, partition=0, value=b"open").get(timeout=30)
        producer.begin_transaction()
        behind = producer.send(topic, partition=0, value=b"behind").get(timeout=30).offset
        producer.commit_transaction()

        assert is_committed(connection, topic, 0, committed, timeout_s=30)
        assert not is_committed(connection, topic, 0, aborted, timeout_s=30)
        with pytest.raises(InfrastructureError, match="did not end within") as raised:
            is_committed(connection, topic, 0, behind, timeout_s=1)
        assert raised.value.retriable
        other.abort_transaction()
        assert is_committed(connection, topic, 0, behind, timeout_s=30)
    finally:
        producer.close()
        other.close()


def test_topics_are_created_once_and_then_exist(kafka_broker, unique_name):
    name = unique_name("created")
    spec = TopicSpec(name, 3, {"cleanup.policy": "compact"})
    connection = Connection(kafka_broker.bootstrap)
    assert create_topics(connection, [spec], replication_factor=1) == {name: CREATED}
    assert create_topics(connection, [spec], replication_factor=1) == {name: EXISTS}
    # a topic just created may have no leader known yet (NOT_LEADER_FOR_PARTITION, retriable: the
    # service retries it): asked again until the broker answers, within a deadline
    ends = wait_for(lambda: Offsets(connection).end([(name, p) for p in range(3)], 10), timeout=60,
                    what="the new topic's end offsets")
    assert ends == {(name, p): 0 for p in range(3)}
