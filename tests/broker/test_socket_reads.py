"""Large socket reads for kafka-python's transports, on a real socket pair."""

from __future__ import annotations

import select
import socket
import threading

import kafka
import pytest
from kafka.errors import KafkaConnectionError
from kafka.net.transport import KafkaSSLTransport, KafkaTCPTransport

from monitor.broker.socket_reads import read_in_large_chunks

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
    """Whatever the test does to the transports is undone after it."""
    for cls in (KafkaTCPTransport, KafkaSSLTransport):
        monkeypatch.setattr(cls, "_sock_recv", cls._sock_recv)


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
    original = KafkaTCPTransport._sock_recv
    assert not read_in_large_chunks(0)
    monkeypatch.setattr(kafka, "__version__", "9.9.9")
    assert not read_in_large_chunks(MIB)
    assert KafkaTCPTransport._sock_recv is original
