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

A librdkafka consumer that meets a fatal error never fetches again. One met here: a
static member whose session timed out in a broker outage rejoins under a new member id,
and the broker then fences its old one (``FENCED_INSTANCE_ID``), which librdkafka
treats as fatal. The member then starts a new client with the same settings: its
partitions are revoked and assigned again, as in any rebalance, and kept ones resume
where this instance left off. A second fatal error within ``RENEW_WINDOW_S`` (another
process with the same group instance id, each fencing the other) stops the service.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, Message, TopicPartition

from monitor.broker.librdkafka import (
    client_error,
    client_log,
    group_metadata,
    librdkafka_config,
    rd_infrastructure_error,
)
from monitor.broker.member import TP, Member
from monitor.errors import InfrastructureError
from monitor.protocol.records import Record

log = logging.getLogger(__name__)
#: consumer errors that stop the service: the principal lost its rights
DENIED = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED,
                    KafkaError.CLUSTER_AUTHORIZATION_FAILED})
#: how long to wait for a metadata or offsets answer
ASK_TIMEOUT_S = 15.0
#: a second fatal consumer error within this long stops the service instead of starting a new client
RENEW_WINDOW_S = 300.0


class RdGroupConsumer(Member):
    def __init__(self, kafka_config: dict[str, Any], group_id: str, topics: Sequence[str], *,
                 max_records: int, max_partition_fetch_bytes: int, group_instance_id: str | None = None,
                 session_timeout_ms: int = 15_000, heartbeat_interval_ms: int = 3_000):
        super().__init__(kafka_config, topics)
        self._max_records = max_records
        self._renewed_at = -RENEW_WINDOW_S
        self._held: set[TP] = set()  #: what the rebalance callbacks assigned and did not revoke
        self._config = librdkafka_config(kafka_config) | {
            "group.id": group_id, "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "session.timeout.ms": session_timeout_ms, "heartbeat.interval.ms": heartbeat_interval_ms,
            "partition.assignment.strategy": "range",
            "max.partition.fetch.bytes": max_partition_fetch_bytes, "fetch.max.bytes": 4 * max_partition_fetch_bytes,
            "queued.max.messages.kbytes": max(1, 4 * max_partition_fetch_bytes // 1024),
            "fetch.queue.backoff.ms": 5, "error_cb": client_error, "logger": client_log,
        }
        if group_instance_id is not None:
            self._config["group.instance.id"] = group_instance_id
        try:
            self._consumer = Consumer(self._config)
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
        self._held |= {(p.topic, p.partition) for p in partitions}
        self.changes.heard_assigned((p.topic, p.partition) for p in partitions)

    def _revoked(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._held -= {(p.topic, p.partition) for p in partitions}
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
        if error.code() in DENIED:
            raise InfrastructureError(f"consuming {message.topic()} failed: {error.name()}: {error.str()}",
                                      retriable=False)
        if error.fatal() or error.code() == KafkaError._FATAL:
            self._renew(error)
        else:
            log.warning("consumer: %s: %s (librdkafka retries by itself)", error.name(), error.str())
        return True

    def _renew(self, error: KafkaError) -> None:
        """Replace a client that failed for good (see the module's docstring)."""
        if time.monotonic() - self._renewed_at < RENEW_WINDOW_S:
            raise InfrastructureError(f"the consumer failed for good twice within {RENEW_WINDOW_S:.0f} s "
                                      f"(does another process use group instance id "
                                      f"{self._config.get('group.instance.id')}?): {error.str()}", retriable=False)
        self._renewed_at = time.monotonic()
        log.warning("the consumer failed for good (%s): starting a new one; its partitions are revoked and assigned "
                    "again", error.str())
        # a failed client forgets its assignment without a callback: revoke what it was given
        self.changes.heard_revoked(self._held)
        self._held = set()
        try:
            self._consumer.close()
        except (KafkaException, RuntimeError) as exc:
            log.info("closing the failed consumer: %s", exc)
        try:
            self._consumer = Consumer(self._config)
        except KafkaException as exc:
            raise rd_infrastructure_error("cannot start a new consumer", exc) from exc
        self.subscribe()

    def assignment(self) -> set[TP]:
        return {(p.topic, p.partition) for p in self._consumer.assignment()}

    def seek(self, positions: dict[TP, int]) -> None:
        for (topic, partition), offset in positions.items():
            try:
                self._consumer.seek(TopicPartition(topic, partition, offset))
            except KafkaException as exc:
                log.warning("cannot resume %s/%d at %d: %s", topic, partition, offset, exc)

    def group_metadata(self) -> Any:
        raw = self._consumer.consumer_group_metadata()
        try:
            return group_metadata(raw)
        except ValueError as exc:
            raise InfrastructureError(str(exc), retriable=False) from exc

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

