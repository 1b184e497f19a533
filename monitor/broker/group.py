"""The consumer group member on kafka-python (see :mod:`monitor.broker.member`).

kafka-python 3.0 runs rebalance listeners on its IO thread, so the listener here blocks
on nothing: it records what changed, and the service acts on it between polls. Offsets
are committed with the outputs, in the output producer's transaction, using this
member's :meth:`GroupConsumer.group_metadata`.

Static membership (``group_instance_id``): a member that restarts within the session
timeout gets its partitions back without a rebalance.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.errors import KafkaError

from monitor.broker.errors import infrastructure_error
from monitor.broker.kafka_python import keep_finished_joins
from monitor.broker.member import TP, Changes, Member
from monitor.errors import InfrastructureError
from monitor.protocol.records import Record

log = logging.getLogger(__name__)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Hands assignment changes to :class:`Changes`; runs on kafka-python's IO thread."""

    def __init__(self, changes: Changes):
        self._changes = changes

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        self._changes.heard_revoked((tp.topic, tp.partition) for tp in revoked)

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self._changes.heard_assigned((tp.topic, tp.partition) for tp in assigned)


class GroupConsumer(Member):
    def __init__(self, kafka_config: dict[str, Any], group_id: str, topics: Sequence[str], *,
                 max_records: int, max_partition_fetch_bytes: int, group_instance_id: str | None = None,
                 session_timeout_ms: int = 15_000, heartbeat_interval_ms: int = 3_000):
        super().__init__(kafka_config, topics)
        keep_finished_joins()  # see monitor.broker.kafka_python
        try:
            self._consumer = KafkaConsumer(
                group_id=group_id, enable_auto_commit=False, auto_offset_reset="earliest",
                group_instance_id=group_instance_id, session_timeout_ms=session_timeout_ms,
                heartbeat_interval_ms=heartbeat_interval_ms,
                # Range assigns partition i of every subscribed topic to the same member:
                # a trace and its outcome (same key, same partition number) meet in one
                # instance. (The sticky assignors do not co-partition.) Range is eager:
                # every rebalance revokes everything, then assigns the full new set.
                partition_assignment_strategy=(RangePartitionAssignor,),
                # Small fetches keep memory flat; a record larger than these limits still
                # arrives (the broker returns at least one record per fetch, KIP-74).
                max_poll_records=max_records, max_partition_fetch_bytes=max_partition_fetch_bytes,
                fetch_max_bytes=4 * max_partition_fetch_bytes, **kafka_config)
        except KafkaError as exc:
            self._end_offsets.close()
            raise infrastructure_error("cannot reach Kafka", exc) from exc

    def check_topics(self, topics: Iterable[str]) -> None:
        for topic in topics:
            try:
                parts = self._consumer.partitions_for_topic(topic)
            except KafkaError as exc:
                raise infrastructure_error(f"cannot describe topic {topic}", exc) from exc
            if not parts:
                raise InfrastructureError(f"topic {topic} does not exist or this principal may not describe it",
                                          retriable=False)

    def subscribe(self) -> None:
        self._consumer.subscribe(self.topics, listener=_Listener(self.changes))

    def _fetch(self, timeout_ms: int) -> list[Record]:
        try:
            batches = self._consumer.poll(timeout_ms=timeout_ms)
        except KafkaError as exc:
            raise infrastructure_error("poll failed", exc) from exc
        return [Record(r.topic, r.partition, r.offset, r.key, r.value, (r.timestamp or 0) / 1000)
                for tp in sorted(batches, key=lambda t: (t.topic, t.partition)) for r in batches[tp]]

    def assignment(self) -> set[TP]:
        return {(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    def seek(self, positions: dict[TP, int]) -> None:
        for (topic, partition), offset in positions.items():
            try:
                self._consumer.seek(TopicPartition(topic, partition), offset)
            except (KafkaError, AssertionError) as exc:
                log.warning("cannot resume %s/%d at %d: %s", topic, partition, offset, exc)

    def group_metadata(self) -> Any:
        return self._consumer.group_metadata()

    def committed(self, partitions: Iterable[TP]) -> dict[TP, int]:
        out = {}
        for topic, partition in partitions:
            try:
                offset = self._consumer.committed(TopicPartition(topic, partition))
            except KafkaError as exc:
                raise infrastructure_error("cannot read committed offsets", exc) from exc
            out[(topic, partition)] = offset or 0
        return out

    def _close_client(self) -> None:
        self._consumer.close(autocommit=False)
