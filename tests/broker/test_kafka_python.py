"""The service's changes to kafka-python: large socket reads (on a real socket pair) and
finished joins (a real consumer group on the real broker)."""

from __future__ import annotations

import select
import socket
import threading
import time

import kafka
import pytest
from kafka import KafkaConsumer
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.coordinator.consumer import ConsumerCoordinator
from kafka.errors import KafkaConnectionError
from kafka.net.transport import KafkaSSLTransport, KafkaTCPTransport

from monitor.broker.kafka_python import keep_finished_joins, read_in_large_chunks

MIB = 1024 * 1024


class Counting:
    """A real socket, with the sizes each ``recv`` asked for written down."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.asked: list[int] = []

    def recv(self, size: int) -> bytes:
        self.asked.append(size)
        return self.sock.recv(size)

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


@pytest.fixture
def transports(monkeypatch):
    """Whatever the test does to the transports or the coordinator is undone after it."""
    for cls in (KafkaTCPTransport, KafkaSSLTransport):
        monkeypatch.setattr(cls, "_sock_recv", cls._sock_recv)
    monkeypatch.setattr(ConsumerCoordinator, "need_rejoin", ConsumerCoordinator.need_rejoin)


def test_reads_take_up_to_the_size_given_until_the_socket_would_block(transports):
    assert read_in_large_chunks(MIB)
    ours, peer = socket.socketpair()
    ours.setblocking(False)
    sent = bytes(range(256)) * (3 * MIB // 256)
    writer = threading.Thread(target=peer.sendall, args=(sent,))
    writer.start()
    counting = Counting(ours)
    transport = KafkaTCPTransport(None, counting)
    received = bytearray()
    while len(received) < len(sent):
        assert select.select([ours], [], [], 10)[0], "the peer stopped sending"
        data, error = transport._sock_recv()
        assert error is None
        received += data
    writer.join()
    assert bytes(received) == sent
    assert set(counting.asked) == {MIB}  # the library asks for 4096 bytes a call

    peer.close()
    data, error = transport._sock_recv()
    assert data == b"" and isinstance(error, KafkaConnectionError)
    ours.close()


def test_the_library_is_left_alone_when_not_asked_or_not_known(transports, monkeypatch):
    original, need_rejoin = KafkaTCPTransport._sock_recv, ConsumerCoordinator.need_rejoin
    assert not read_in_large_chunks(0)
    monkeypatch.setattr(kafka, "__version__", "9.9.9")
    assert not read_in_large_chunks(MIB)
    assert not keep_finished_joins()
    assert KafkaTCPTransport._sock_recv is original and ConsumerCoordinator.need_rejoin is need_rejoin


class Changes(ConsumerRebalanceListener):
    def __init__(self) -> None:
        self.revoked = 0
        self.assigned: list[set[int]] = []

    def on_partitions_revoked(self, revoked) -> None:
        self.revoked += 1

    def on_partitions_assigned(self, assigned) -> None:
        self.assigned.append({tp.partition for tp in assigned})


@pytest.mark.kafka
def test_a_member_collects_the_join_a_timed_out_poll_left_behind(transports, kafka_broker, admin, make_topic,
                                                                 unique_name):
    """The group's metadata changes (a partition added), the member's next poll starts
    the rejoin and gives up at once, and the member is busy elsewhere while the join
    completes on the broker: its later polls must still apply the assignment (without
    the change they see no rejoin needed, hold nothing and fetch nothing)."""
    assert keep_finished_joins()
    topic, group = make_topic("joins", partitions=1), unique_name("group")
    consumer = KafkaConsumer(bootstrap_servers=kafka_broker.bootstrap, group_id=group,
                             enable_auto_commit=False, auto_offset_reset="earliest", metadata_max_age_ms=200)
    changes = Changes()
    try:
        consumer.subscribe([topic], listener=changes)
        deadline = time.monotonic() + 60
        while not changes.assigned:
            assert time.monotonic() < deadline, "never assigned"
            consumer.poll(timeout_ms=200)
        for partitions in range(2, 7):  # the join may complete within the poll: then again, one partition more
            revoked, assigned = changes.revoked, len(changes.assigned)
            admin.create_partitions({topic: partitions})
            while changes.revoked == revoked:  # the rejoin revokes everything first (eager)
                assert time.monotonic() < deadline, "the added partition never made the member rejoin"
                consumer.poll(timeout_ms=0)
            if len(changes.assigned) > assigned:
                continue
            # the join completes on the broker meanwhile (the member's IO thread carries
            # it), uncollected by any poll
            while admin.describe_groups([group])[group]["group_state"] != "Stable":
                assert time.monotonic() < deadline, "the rejoin never completed on the broker"
            while len(changes.assigned) == assigned:
                assert time.monotonic() < deadline, "the member never applied the assignment of its rejoin"
                consumer.poll(timeout_ms=200)
            assert changes.assigned[-1] == set(range(partitions))
            return
        pytest.skip("every rejoin completed within the poll that started it: none was left behind")
    finally:
        consumer.close(autocommit=False)
