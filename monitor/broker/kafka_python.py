"""What the service changes in kafka-python 3.0, and why.

Each change replaces one method, only on the kafka-python versions it was written
against (on any other it leaves the library alone and says so), and is tested in
``tests/broker/test_kafka_python.py``.

Socket reads (:func:`read_in_large_chunks`)
    kafka-python reads a socket 4 KiB at a time (``_sock_recv`` of its transports), and
    every ``recv`` lets go of the interpreter lock and takes it back: a fetch of 8 MiB
    is 2,000 calls, and while the service's other threads (the pipeline's, the
    measuring results reader, the output producer's network thread) want the lock,
    each call may wait its turn. On the service bench (129 KiB traces, two cores) a
    busy second thread cut a bare consumer from 4,500 to 3,000 records/s; read 1 MiB
    per call, the consumer kept 4,700, and the service went from 2,060 to 2,640
    traces/s with 0.57 ms of CPU a trace instead of 0.70. The replacement keeps the
    library's contract: read until the socket would block; an empty read (the broker
    closed) or an error ends the read with a connection error.

Finished joins (:func:`keep_finished_joins`)
    A member that must rejoin because the group's topic metadata changed (partitions
    added, or topics created just before it started) sends JoinGroup and, as leader,
    computes the assignment, which makes ``need_rejoin()`` false again while the join
    is still on the wire. If the ``poll`` that started the join times out meanwhile
    (its result stays pending, for the next poll to collect), the next poll sees no
    need to rejoin and never collects it: the assignment is never applied, heartbeats
    stay disabled, and the member fetches nothing, without an error, for good. Seen
    here as a service that stopped consuming one start in ten on the test broker. With
    the change, a join whose result was not collected counts as a rejoin needed, so
    the next poll completes it.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from typing import Any

import kafka
from kafka.coordinator.consumer import ConsumerCoordinator
from kafka.errors import KafkaConnectionError
from kafka.net.transport import KafkaSSLTransport, KafkaTCPTransport

log = logging.getLogger(__name__)

#: the kafka-python versions whose internals these changes were written against
KNOWN_VERSIONS = ("3.0.",)
_WOULD_BLOCK: tuple[type[BaseException], ...] = (BlockingIOError, InterruptedError)
_TLS_WOULD_BLOCK = (*_WOULD_BLOCK, ssl.SSLWantReadError, ssl.SSLWantWriteError)
_need_rejoin = ConsumerCoordinator.need_rejoin


def read_in_large_chunks(size: int) -> bool:
    """Read Kafka sockets up to ``size`` bytes per call (0: the library's own 4 KiB);
    True if the transports now do."""
    if size <= 0 or not _known("its sockets are read 4 KiB at a time"):
        return False
    KafkaTCPTransport._sock_recv = _reader(size, _WOULD_BLOCK)
    KafkaSSLTransport._sock_recv = _reader(size, _TLS_WOULD_BLOCK)
    return True


def keep_finished_joins() -> bool:
    """Make a group member collect every join it started; True if it now does."""
    if not _known("a consumer whose poll times out during a rebalance may stop fetching"):
        return False
    ConsumerCoordinator.need_rejoin = _need_rejoin_or_collect
    return True


def _known(otherwise: str) -> bool:
    if kafka.__version__.startswith(KNOWN_VERSIONS):
        return True
    log.warning("kafka-python %s is not a version this service adapts (%s): %s", kafka.__version__,
                ", ".join(KNOWN_VERSIONS), otherwise)
    return False


def _need_rejoin_or_collect(coordinator: Any) -> bool:
    return getattr(coordinator, "_join_task", None) is not None or bool(_need_rejoin(coordinator))


def _reader(size: int, would_block: tuple[type[BaseException], ...]) -> Callable[[Any], tuple[bytes, Any]]:
    def _sock_recv(transport: Any) -> tuple[bytes, KafkaConnectionError | None]:
        chunks: list[bytes] = []
        error = None
        while True:
            try:
                data = transport._sock.recv(size)
            except would_block:
                break
            except Exception as exc:
                log.warning("%s: receiving failed, closing the connection: %s", transport, exc)
                error = KafkaConnectionError(exc)
                break
            if not data:
                log.warning("%s: the broker closed the connection", transport)
                error = KafkaConnectionError("socket disconnected")
                break
            chunks.append(data)
        return b"".join(chunks), error

    return _sock_recv
