"""The consumer group member on librdkafka (see :mod:`monitor.broker.member` and
:mod:`monitor.broker.librdkafka`).

librdkafka fetches in its own threads and calls the rebalance callbacks from ``poll``,
on the service's main thread; with them it assigns (or unassigns) the partitions itself.
Assignment, static membership and the group metadata for transactional commits are as
with kafka-python: the range assignor (eager; it keeps a trace and its outcome in one
instance), ``group.instance.id`` when given.

Two librdkafka settings matter here. ``fetch.queue.backoff.ms``: while its local queue
is full librdkafka waits this long before fetching again, 1 s by default; the service
drains the queue in bursts (as the measuring process frees room), and at 1 s it ran at
900 traces/s against 2,100 on the service bench, waiting in ``poll`` 57 % of the time.
``queued.max.messages.kbytes`` bounds that queue (64 MiB by default) to four fetches'
worth, which keeps memory flat.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, Message, TopicPartition

from monitor.broker.librdkafka import librdkafka_config, rd_infrastructure_error
from monitor.broker.member import TP, Member
from monitor.errors import InfrastructureError
from monitor.records import Record

log = logging.getLogger(__name__)
#: consumer errors that stop the service: the principal lost its rights
DENIED = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED,
                    KafkaError.CLUSTER_AUTHORIZATION_FAILED})
#: how long to wait for a metadata or offsets answer
ASK_TIMEOUT_S = 15.0


class RdGroupConsumer(Member):
    def __init__(self, kafka_config: dict[str, Any], group_id: str, topics: Sequence[str], *,
                 max_records: int, max_partition_fetch_bytes: int, group_instance_id: str | None = None,
                 session_timeout_ms: int = 15_000, heartbeat_interval_ms: int = 3_000):
        super().__init__(kafka_config, topics)
        self._max_records = max_records
        config = librdkafka_config(kafka_config) | {
            "group.id": group_id, "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "session.timeout.ms": session_timeout_ms, "heartbeat.interval.ms": heartbeat_interval_ms,
            "partition.assignment.strategy": "range",
            "max.partition.fetch.bytes": max_partition_fetch_bytes, "fetch.max.bytes": 4 * max_partition_fetch_bytes,
            "queued.max.messages.kbytes": max(1, 4 * max_partition_fetch_bytes // 1024),
            "fetch.queue.backoff.ms": 5, "error_cb": _log_error, "logger": log,
        }
        if group_instance_id is not None:
            config["group.instance.id"] = group_instance_id
        try:
            self._consumer = Consumer(config)
        except KafkaException as exc:
            self._end_offsets.close()
            raise rd_infrastructure_error("cannot start the consumer", exc) from exc

    def check_topics(self, topics: Iterable[str]) -> None:
        for topic in topics:
            try:
                found = self._consumer.list_topics(topic, timeout=ASK_TIMEOUT_S).topics.get(topic)
            except KafkaException as exc:
                raise rd_infrastructure_error(f"cannot describe topic {topic}", exc) from exc
            if found is None or found.error is not None or not found.partitions:
                raise InfrastructureError(f"topic {topic} does not exist or this principal may not describe it",
                                          retriable=False)

    def subscribe(self) -> None:
        self._consumer.subscribe(self.topics, on_assign=self._assigned, on_revoke=self._revoked,
                                 on_lost=self._revoked)

    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.changes.heard_assigned((p.topic, p.partition) for p in partitions)

    def _revoked(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.changes.heard_revoked((p.topic, p.partition) for p in partitions)

    def _fetch(self, timeout_ms: int) -> list[Record]:
        # poll waits for the first message; consume then takes what is queued without
        # waiting (consume alone waits for a full batch or the whole timeout)
        try:
            first = self._consumer.poll(timeout_ms / 1000)
            messages = [] if first is None else [first, *self._consumer.consume(self._max_records - 1, 0)]
        except KafkaException as exc:
            raise rd_infrastructure_error("poll failed", exc) from exc
        records = [_record(m) for m in messages if not self._failed(m)]
        records.sort(key=lambda r: (r.topic, r.partition))  # stable: offsets stay in order
        return records

    def _failed(self, message: Message) -> bool:
        error = message.error()
        if error is None:
            return False
        if error.fatal() or error.code() in DENIED:
            raise InfrastructureError(f"consuming {message.topic()} failed: {error.name()}: {error.str()}",
                                      retriable=False)
        log.warning("consumer: %s: %s (librdkafka retries by itself)", error.name(), error.str())
        return True

    def assignment(self) -> set[TP]:
        return {(p.topic, p.partition) for p in self._consumer.assignment()}

    def seek(self, positions: dict[TP, int]) -> None:
        for (topic, partition), offset in positions.items():
            try:
                self._consumer.seek(TopicPartition(topic, partition, offset))
            except KafkaException as exc:
                log.warning("cannot resume %s/%d at %d: %s", topic, partition, offset, exc)

    def group_metadata(self) -> Any:
        return self._consumer.consumer_group_metadata()

    def committed(self, partitions: Iterable[TP]) -> dict[TP, int]:
        asked = [TopicPartition(topic, partition) for topic, partition in partitions]
        if not asked:
            return {}
        try:
            answered = self._consumer.committed(asked, timeout=ASK_TIMEOUT_S)
        except KafkaException as exc:
            raise rd_infrastructure_error("cannot read committed offsets", exc) from exc
        return {(p.topic, p.partition): 0 if p.offset == OFFSET_INVALID else p.offset for p in answered}

    def _close_client(self) -> None:
        self._consumer.close()


def _record(m: Message) -> Record:
    _kind, stamp = m.timestamp()
    return Record(m.topic() or "", m.partition() or 0, m.offset() or 0, m.key(), m.value(), max(stamp, 0) / 1000)


def _log_error(error: KafkaError) -> None:
    log.warning("Kafka client: %s: %s", error.name(), error.str())
