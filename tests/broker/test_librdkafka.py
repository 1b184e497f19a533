"""The group member on librdkafka (confluent-kafka) against the real broker:
its group metadata, read from librdkafka's, fences the output producer's commits
(KIP-447): one for a generation the group has left is refused, and the rejoined member
commits under its new one; a static member fenced by its own instance id starts a new
client once and stops the second time; the connection settings reach librdkafka;
librdkafka's repeated complaints are logged once, then counted."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from confluent_kafka import KafkaError, KafkaException
from kafka import KafkaConsumer
from kafka.structs import MemberState

from monitor.broker import librdkafka
from monitor.broker.connection import Connection
from monitor.broker.errors import from_librdkafka
from monitor.broker.group import Changes, GroupMember
from monitor.broker.librdkafka import QuietRepeats, group_metadata
from monitor.broker.outputs import GroupMovedOn, OutputProducer
from monitor.errors import InfrastructureError
from monitor.protocol.records import Output


def test_one_connection_value_in_each_clients_words():
    sasl = Connection("a:9092, b:9092", "m", "SASL_SSL", "SCRAM-SHA-512", "u", "p", "/ca.pem")
    assert sasl.librdkafka() == {
        "bootstrap.servers": "a:9092,b:9092", "security.protocol": "SASL_SSL", "client.id": "m",
        "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "u", "sasl.password": "p", "ssl.ca.location": "/ca.pem"}
    assert sasl.kafka_python() == {
        "bootstrap_servers": ["a:9092", "b:9092"], "security_protocol": "SASL_SSL", "client_id": "m",
        "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "u", "sasl_plain_password": "p",
        "ssl_cafile": "/ca.pem"}
    assert "'p'" not in repr(sasl)
    plain = Connection("a:9092")
    assert plain.librdkafka() == {"bootstrap.servers": "a:9092", "security.protocol": "PLAINTEXT",
                                  "client.id": "attention-monitor"}
    assert Connection("a:9092", ssl_cafile="/ca.pem").librdkafka().get("ssl.ca.location") is None  # TLS not asked for
    with pytest.raises(ValueError, match="SASL username and password"):
        Connection("a:9092", security_protocol="SASL_PLAINTEXT")
    with pytest.raises(ValueError, match="names no broker"):
        Connection(" , ")
    with pytest.raises(ValueError, match="go together"):
        Connection("a:9092", security_protocol="SSL", ssl_certfile="/c.pem")


def test_what_a_broker_restart_gives_is_retried_whatever_librdkafkas_flag():
    """librdkafka leaves the retriable flag unset on most broker errors: a leader-epoch
    error after a broker restart stopped a new owner reading its pending outcomes."""
    restart = KafkaError(KafkaError.FENCED_LEADER_EPOCH)
    assert not restart.retriable()  # librdkafka's own word
    assert from_librdkafka("cannot read offsets", KafkaException(restart)).retriable
    assert from_librdkafka("poll failed", KafkaError(KafkaError._TRANSPORT)).retriable
    assert not from_librdkafka("poll failed", KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)).retriable
    assert not from_librdkafka("poll failed", KafkaError(KafkaError._TRANSPORT, fatal=True)).retriable


def test_group_metadata_read_from_librdkafkas_own():
    assert group_metadata(b"CGMDv2:\x07\x00\x00\x00grp\x00member-1\x00\x00inst\x00") == (
        "grp", 7, "member-1", "inst", MemberState.UNJOINED)
    assert group_metadata(b"CGMDv2:\xff\xff\xff\xffgrp\x00\x00\x01")[:4] == ("grp", -1, "", None)
    for unknown in (b"CGMDv3:\x07\x00\x00\x00grp\x00m\x00\x01", b"CGMDv2:\x07\x00", b"CGMDv2:\x07\x00\x00\x00grp",
                    b"CGMDv2:\x07\x00\x00\x00grp\x00m\x00\x02"):
        with pytest.raises(ValueError, match="group metadata"):
            group_metadata(unknown)


def test_repeats_of_a_message_but_for_its_numbers_are_held_back_then_counted(monkeypatch):
    quiet, passed = QuietRepeats(), []

    def log(text):
        record = logging.LogRecord("librdkafka", logging.WARNING, __file__, 0, text, (), None)
        if quiet.filter(record):
            passed.append(record.getMessage())

    for port in range(100):
        log(f"Connect to 127.0.0.1:{9000 + port} failed: Connection refused (after {port}ms)")
    log("Disconnected: connection closed by peer")
    assert passed == ["Connect to 127.0.0.1:9000 failed: Connection refused (after 0ms)",
                      "Disconnected: connection closed by peer"]
    monkeypatch.setattr(librdkafka, "REPEAT_S", 0.0)
    log("Connect to 127.0.0.1:9100 failed: Connection refused (after 7ms)")
    assert passed[-1].startswith("Connect to 127.0.0.1:9100 failed: Connection refused (after 7ms) (99 like it in")


def member(bootstrap, group, topic, instance=None, **settings):
    return GroupMember(Connection(bootstrap), group, [topic], max_records=10,
                       max_partition_fetch_bytes=1 << 20, session_timeout_ms=6_000, heartbeat_interval_ms=500,
                       group_instance_id=instance, **settings)


def poll_until(consumer, condition, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        consumer.poll(200)


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
    producer = OutputProducer(Connection(bootstrap), unique_name("txn"), delivery_timeout_ms=10_000,
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
        assert stale[:4] == (group, stale.generation_id, a.member_id, None)
        assert stale.generation_id >= 1
        b.subscribe()  # the second member joins: a rebalance, driven by its polls here
        joining = threading.Thread(target=lambda: [b.poll(200) for _ in iter(stop.is_set, True)], daemon=True)
        joining.start()
        seen = a.changes.assignments
        poll_until(a, lambda: a.changes.assignments > seen, "the first member never got its new assignment")
        kept = a.assignment()
        assert len(kept) == 1, kept

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
def test_a_static_member_fenced_once_starts_a_new_client_and_stops_when_fenced_again(kafka_broker, make_topic,
                                                                                     unique_name):
    bootstrap = kafka_broker.bootstrap
    topic, group, instance = make_topic("traces", partitions=2), unique_name("group"), unique_name("instance")
    both = {(topic, 0), (topic, 1)}
    a = member(bootstrap, group, topic, instance)
    others = []
    try:
        a.subscribe()
        poll_until(a, lambda: a.assignment() == both, "the member never got its partitions")
        a.changes.take()
        others.append(member(bootstrap, group, topic, instance))  # a second process with the same instance id
        others[-1].subscribe()
        poll_until(others[-1], lambda: others[-1].assignment() == both, "the second process never took over")
        others[-1].close()  # a static member stays in the group: its partitions wait for the instance id

        # a's next request is refused (FENCED_INSTANCE_ID, fatal in librdkafka): a new client
        # takes the instance id back, its partitions revoked and then assigned again
        seen = a.changes.assignments
        poll_until(a, lambda: a.changes.assignments > seen, "the fenced member never started a new client")
        revoked, assigned = a.changes.take()
        assert revoked == both and assigned == both

        others.append(member(bootstrap, group, topic, instance))
        others[-1].subscribe()
        with pytest.raises(InfrastructureError, match=f"twice within .* group instance id {instance}") as raised:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                others[-1].poll(100)
                a.poll(100)
        assert not raised.value.retriable
    finally:
        for consumer in (a, *others):
            consumer.close()


@pytest.mark.kafka
def test_the_rebalance_timeout_reaches_librdkafka(kafka_broker, make_topic, unique_name):
    """REBALANCE_TIMEOUT_MS is librdkafka's max.poll.interval.ms: how long the broker
    waits for a member to rejoin, and librdkafka for its JoinGroup's answer (a join lost
    to a broker restart kept a member out for five minutes at the default). A member
    that stops polling holds up a rebalance for that long: here 6 s, where the default
    would hold the newcomer back for 300 s."""
    bootstrap = kafka_broker.bootstrap
    topic, group = make_topic("traces", partitions=2), unique_name("group")
    both = {(topic, 0), (topic, 1)}
    silent, newcomer = member(bootstrap, group, topic, rebalance_timeout_ms=6_000), member(bootstrap, group, topic)
    try:
        silent.subscribe()
        poll_until(silent, lambda: silent.assignment() == both, "the first member never got its partitions")
        newcomer.subscribe()  # a rebalance; the first member no longer polls to rejoin it
        poll_until(newcomer, lambda: newcomer.assignment() == both, "the newcomer waited for the silent member",
                   timeout=45)
    finally:
        newcomer.close()
        silent.close()


def test_a_fencing_after_a_broker_outage_starts_a_new_client_again_and_one_without_stops():
    """Two broker restarts a minute apart fence a static member twice (its session times
    out in each outage): each follows an outage, so each starts a new client; two fencings
    with the brokers reachable in between are another process with the same instance id.
    The outage here is librdkafka's own: its brokers' port is closed."""
    closed = member("127.0.0.1:1", "a-group", "traces", "an-instance")
    fenced = KafkaError(KafkaError._FATAL, "fenced", fatal=True)

    def outage_heard() -> bool:
        closed.poll(100)
        return closed._outage_since_renewal

    try:
        closed.subscribe()
        for _ in range(2):  # fenced after an outage, twice within RENEW_WINDOW_S: a new client each time
            poll_until(closed, outage_heard, "librdkafka never said its broker was unreachable", timeout=30)
            closed._renew(fenced)
        with pytest.raises(InfrastructureError, match="twice within") as raised:
            closed._renew(fenced)  # no outage heard since the last new client
        assert not raised.value.retriable
    finally:
        closed.close()


def test_changes_tell_an_empty_assignment_from_none_and_forget_one_revoked_before_it_was_taken():
    changes = Changes()
    assert changes.take() == (set(), None)  # nothing heard
    changes.heard_revoked({("t", 0)})
    changes.heard_assigned([])  # more members than partitions: this one stands by
    assert changes.take() == ({("t", 0)}, set())
    changes.heard_assigned([("t", 0)])
    changes.heard_revoked({("t", 0)})  # revoked before the service saw it: the next one counts
    assert changes.take() == ({("t", 0)}, None)
    changes.heard_assigned([("t", 1)])
    changes.heard_assigned([("t", 2)])  # eager: each assignment is the whole set
    assert changes.take() == (set(), {("t", 2)})
