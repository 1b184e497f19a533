"""Partition offsets asked on a connection of their own (an admin client's).

The broker answers one connection's requests in order, and a consumer's connection
carries its long-poll fetches: an offsets request on it waits behind the fetch for up to
``fetch.wait.max.ms``. A client that never fetches answers in a round trip, so the lag
check, the table readers and the tail readers ask here.
"""

from __future__ import annotations

from collections.abc import Iterable

from confluent_kafka import IsolationLevel, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from monitor.broker.connection import Connection
from monitor.broker.errors import from_librdkafka
from monitor.broker.librdkafka import client_error, client_log
from monitor.errors import InfrastructureError

TP = tuple[str, int]


class Offsets:
    """After a failed request the admin client is replaced: librdkafka's admin client
    keeps answering from metadata it cached before a broker restart
    (``FENCED_LEADER_EPOCH``) instead of looking again."""

    def __init__(self, connection: Connection):
        self._config = connection.librdkafka() | {"error_cb": client_error, "logger": client_log}
        self._admin = AdminClient(self._config)

    def end(self, partitions: Iterable[TP], timeout_s: float, committed: bool = False) -> dict[TP, int]:
        """The end offset of each partition: the high watermark, or with ``committed``
        the last stable offset (what a ``read_committed`` reader can reach)."""
        return self._ask(partitions, OffsetSpec.latest(), timeout_s,  # type: ignore[no-untyped-call]
                         IsolationLevel.READ_COMMITTED if committed else IsolationLevel.READ_UNCOMMITTED)

    def beginning(self, partitions: Iterable[TP], timeout_s: float) -> dict[TP, int]:
        """The first offset still held of each partition."""
        earliest = OffsetSpec.earliest()  # type: ignore[no-untyped-call]
        return self._ask(partitions, earliest, timeout_s, IsolationLevel.READ_UNCOMMITTED)

    def _ask(self, partitions: Iterable[TP], spec: OffsetSpec, timeout_s: float,
             isolation: IsolationLevel) -> dict[TP, int]:
        asked = {TopicPartition(t, p): spec for t, p in partitions}
        if not asked:
            return {}
        try:
            futures = self._admin.list_offsets(asked, request_timeout=timeout_s, isolation_level=isolation)
            return {(tp.topic, tp.partition): future.result(timeout=timeout_s + 5).offset
                    for tp, future in futures.items()}
        except KafkaException as exc:
            self._admin = AdminClient(self._config)
            raise from_librdkafka("cannot read offsets", exc) from exc
        except TimeoutError as exc:
            self._admin = AdminClient(self._config)
            raise InfrastructureError(f"no offsets within {timeout_s:.0f} s", retriable=True) from exc

    def close(self) -> None:
        """Nothing to flush: confluent-kafka's admin client closes its connections when
        it is dropped."""
