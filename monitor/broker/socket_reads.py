"""How the service's Kafka clients read their sockets.

kafka-python 3.0 reads a socket 4 KiB at a time (``_sock_recv`` of its transports), and
every ``recv`` lets go of the interpreter lock and takes it back: a fetch of 8 MiB is
2,000 calls, and while the service's other threads (the pipeline's, the measuring
results reader, the output producer's network thread) want the lock, each call may wait
its turn. On the service bench (129 KiB traces, two cores) a busy second thread cut a
bare consumer from 4,500 to 3,000 records/s; read 1 MiB per call, the consumer kept
4,700, and the service went from 2,060 to 2,640 traces/s with 0.57 ms of CPU a trace
instead of 0.70.

:func:`read_in_large_chunks` makes both transports (plain and TLS) read up to a given
size per call, with the library's own contract: read until the socket would block; an
empty read (the broker closed) or an error ends the read with a connection error. It
replaces that one method, and only on the kafka-python versions it was written against;
on any other it leaves the library alone and says so.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from typing import Any

import kafka
from kafka.errors import KafkaConnectionError
from kafka.net.transport import KafkaSSLTransport, KafkaTCPTransport

log = logging.getLogger(__name__)

#: the kafka-python versions whose transports read through ``_sock_recv`` as assumed here
KNOWN_VERSIONS = ("3.0.",)
_WOULD_BLOCK: tuple[type[BaseException], ...] = (BlockingIOError, InterruptedError)
_TLS_WOULD_BLOCK = (*_WOULD_BLOCK, ssl.SSLWantReadError, ssl.SSLWantWriteError)


def read_in_large_chunks(size: int) -> bool:
    """Read Kafka sockets up to ``size`` bytes per call (0: the library's own 4 KiB);
    True if the transports now do."""
    if size <= 0:
        return False
    if not kafka.__version__.startswith(KNOWN_VERSIONS):
        log.warning("kafka-python %s is not a version this service adapts (%s): its sockets are read "
                    "4 KiB at a time", kafka.__version__, ", ".join(KNOWN_VERSIONS))
        return False
    KafkaTCPTransport._sock_recv = _reader(size, _WOULD_BLOCK)
    KafkaSSLTransport._sock_recv = _reader(size, _TLS_WOULD_BLOCK)
    return True


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
