"""Reads a compacted topic in full into a table: every instance knows every model
contract (``attention-contracts``) and every reference decision (``attention-references``).

The reader is a consumer outside any group (it assigns every partition to itself from
the beginning and never commits), so every instance reads the whole topic.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Protocol

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from monitor.broker.connection import Connection
from monitor.broker.errors import from_librdkafka
from monitor.broker.librdkafka import client_error, client_log
from monitor.broker.offsets import Offsets
from monitor.errors import InfrastructureError

log = logging.getLogger(__name__)
#: records taken from the client's queue in one call
BATCH = 500


class Table(Protocol):
    def apply(self, key: bytes | None, value: bytes | None) -> str | None:
        """Apply one record; its id, or None when refused."""


def reader_config(connection: Connection, **extra: object) -> dict[str, object]:
    """A consumer that reads assigned partitions and never joins a group or commits
    (librdkafka wants a group id all the same: a fresh one, used for nothing)."""
    return connection.librdkafka() | {"group.id": f"{connection.client_id}-reader-{uuid.uuid4().hex[:12]}",
                                      "enable.auto.commit": False, "enable.auto.offset.store": False,
                                      "error_cb": client_error, "logger": client_log, **extra}


class TableReader:
    """Reads a compacted topic from its beginning into ``table``, then keeps up."""

    def __init__(self, connection: Connection, topic: str, table: Table, ask_timeout_s: float = 15.0):
        self.table = table
        self.topic = topic
        try:
            self._offsets = Offsets(connection)
            self._consumer = Consumer(reader_config(connection, **{"enable.partition.eof": True}))
            found = self._consumer.list_topics(topic, timeout=ask_timeout_s).topics.get(topic)
        except KafkaException as exc:
            raise from_librdkafka(f"cannot reach Kafka for {topic}", exc) from exc
        if found is None or found.error is not None or not found.partitions:
            self._consumer.close()
            raise InfrastructureError(f"topic {topic} does not exist or this principal may not describe it",
                                      retriable=False)
        self._partitions = sorted(found.partitions)
        self._next = dict.fromkeys(self._partitions, 0)  #: next offset to apply, per partition
        self._consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in self._partitions])

    def load(self, timeout_s: float) -> None:
        """Read to the end offsets as of now."""
        end = self._offsets.end([(self.topic, p) for p in self._partitions], timeout_s)
        deadline = time.monotonic() + timeout_s
        while any(self._next[p] < end[(self.topic, p)] for p in self._partitions):
            if time.monotonic() > deadline:
                raise InfrastructureError(f"timed out reading {self.topic}", retriable=True)
            self.refresh(0.5)

    def refresh(self, timeout_s: float = 0.0) -> None:
        """Apply what has arrived (waiting up to ``timeout_s`` for the first record)."""
        try:
            messages = self._consumer.consume(BATCH, timeout_s)
        except KafkaException as exc:
            raise from_librdkafka(f"reading {self.topic} failed", exc) from exc
        for m in messages:
            error = m.error()
            if error is not None and error.code() == KafkaError._PARTITION_EOF:  # caught up, past any gap
                self._next[m.partition() or 0] = max(self._next[m.partition() or 0], m.offset() or 0)
                continue
            if error is not None:
                if error.fatal():
                    raise from_librdkafka(f"reading {self.topic} failed", error)
                log.warning("reading %s: %s: %s (librdkafka retries by itself)", self.topic, error.name(), error.str())
                continue
            partition, offset = m.partition() or 0, m.offset() or 0
            self._next[partition] = offset + 1
            if self.table.apply(m.key(), m.value()) is None:
                log.warning("refused record %s/%d@%d", self.topic, partition, offset)

    def close(self) -> None:
        self._consumer.close()
        self._offsets.close()
