"""The real broker works in both profiles: round trips, SCRAM authentication, ACLs."""

from __future__ import annotations

import time

import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import (
    GroupAuthorizationFailedError,
    KafkaTimeoutError,
    TopicAuthorizationFailedError,
)

from devstack.kafka import create_scram_user, grant
from devstack.wait import wait_for

pytestmark = pytest.mark.kafka


def _consume(config: dict, topic: str, group: str, want: int, timeout: float = 15.0) -> list:
    """Poll until ``want`` records arrived or the deadline passed; errors propagate."""
    consumer = KafkaConsumer(topic, group_id=group, auto_offset_reset="earliest",
                             enable_auto_commit=False, **config)
    try:
        records: list = []
        deadline = time.monotonic() + timeout
        while len(records) < want and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
        return records
    finally:
        consumer.close()


def test_round_trip_with_headers(kafka_broker, make_topic, unique_name):
    topic = make_topic("roundtrip", partitions=3)
    producer = KafkaProducer(**kafka_broker.client_config(), compression_type="zstd")
    for i in range(20):
        producer.send(topic, key=f"req-{i}".encode(), value=bytes([i]) * 100,
                      headers=[("schema", b"1"), ("index", str(i).encode())])
    producer.flush()
    producer.close()

    records = _consume(kafka_broker.client_config(), topic, unique_name("group"), want=20)

    assert sorted(r.key for r in records) == sorted(f"req-{i}".encode() for i in range(20))
    for r in records:
        headers = dict(r.headers)
        i = int(headers["index"])
        assert headers["schema"] == b"1"
        assert r.value == bytes([i]) * 100
    assert {r.partition for r in records} <= {0, 1, 2}


def _produce(config: dict, topic: str, n: int) -> None:
    producer = KafkaProducer(**config)
    for i in range(n):
        producer.send(topic, key=str(i).encode(), value=b"v")
    producer.flush()
    producer.close()


def test_scram_acl_grants_and_denies(scram_broker, scram_admin, make_scram_topic, unique_name):
    topic = make_scram_topic("secured")
    _produce(scram_broker.client_config(), topic, 3)  # as the super user
    reader, outsider = unique_name("reader"), unique_name("outsider")
    create_scram_user(scram_admin, reader, "reader-pw")
    create_scram_user(scram_admin, outsider, "outsider-pw")
    group = unique_name("group")
    grant(scram_admin, reader, topics={topic: ["READ", "DESCRIBE"]}, groups={group: ["READ"]})

    allowed = _consume(scram_broker.client_config(reader, "reader-pw"), topic, group, want=3)
    assert len(allowed) == 3

    # No group ACL: the group coordinator refuses first.
    with pytest.raises(GroupAuthorizationFailedError):
        _consume(scram_broker.client_config(outsider, "outsider-pw"), topic, unique_name("group"), want=1)

    # A group ACL but no ACL at all on the topic: the broker hides the topic, and a
    # subscribing consumer gets nothing and no error. (The service checks that its
    # topics are visible at start-up for this reason.)
    other_group = unique_name("group")
    grant(scram_admin, outsider, groups={other_group: ["READ"]})
    blind = KafkaConsumer(group_id=other_group, **scram_broker.client_config(outsider, "outsider-pw"))
    try:
        assert not blind.partitions_for_topic(topic)
    finally:
        blind.close()

    # DESCRIBE without READ: fetching is refused with the kafka-python error.
    grant(scram_admin, outsider, topics={topic: ["DESCRIBE"]})
    with pytest.raises(TopicAuthorizationFailedError):
        _consume(scram_broker.client_config(outsider, "outsider-pw"), topic, other_group, want=1)

    # Nor may the reader write. (Idempotence is off here: an idempotent producer of a
    # principal with WRITE on no topic is refused earlier, at InitProducerId, with
    # ClusterAuthorizationFailedError wrapped in a plain KafkaError.)
    with pytest.raises(TopicAuthorizationFailedError):
        producer = KafkaProducer(**scram_broker.client_config(reader, "reader-pw"),
                                 enable_idempotence=False, max_block_ms=10000)
        try:
            producer.send(topic, b"x").get(timeout=10)
        finally:
            producer.close()


def test_scram_wrong_password_is_refused(scram_broker):
    # The broker closes the connection on bad SCRAM credentials; kafka-python 3.0 sees
    # a disconnect, retries until its bootstrap deadline and raises KafkaTimeoutError.
    # The reason is in the broker's log, not in the client's exception.
    log = scram_broker.process.log_path
    before = log.read_text().count("invalid credentials")
    with pytest.raises(KafkaTimeoutError, match="Unable to bootstrap"):
        KafkaProducer(**scram_broker.client_config("admin", "not-the-password"), max_block_ms=3000)
    wait_for(lambda: log.read_text().count("invalid credentials") > before, timeout=10,
             what="broker logging the failed SCRAM authentication")
