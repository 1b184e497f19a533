"""The consumer group member: ``subscribe``, ``poll``, ``seek``, ``lag``, ``close``.

kafka-python 3.0 runs rebalance listeners on its IO thread, so the listener here blocks
on nothing: it records what changed, and the service acts on it between polls. Offsets
are committed with the outputs, in the output producer's transaction, using this
member's :meth:`GroupConsumer.group_metadata`.

Static membership (``group_instance_id``): a member that restarts within the session
timeout gets its partitions back without a rebalance.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.errors import KafkaError

from monitor.broker.end_offsets import EndOffsets
from monitor.broker.errors import infrastructure_error
from monitor.broker.kafka_python import keep_finished_joins
from monitor.errors import InfrastructureError
from monitor.records import Record

log = logging.getLogger(__name__)
TP = tuple[str, int]


class _Changes(ConsumerRebalanceListener):  # type: ignore[misc]
    """Remembers assignment changes; runs on kafka-python's IO thread, so it only records."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.revoked: set[TP] = set()
        self.assigned: set[TP] = set()
        self.assignments = 0  #: assignments received so far (an empty one counts too)

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        with self._lock:
            self.revoked |= {(tp.topic, tp.partition) for tp in revoked}

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        with self._lock:
            self.assigned |= {(tp.topic, tp.partition) for tp in assigned}
            self.assignments += 1

    def take(self) -> tuple[set[TP], set[TP]]:
        with self._lock:
            revoked, assigned = self.revoked, self.assigned
            self.revoked, self.assigned = set(), set()
        return revoked, assigned


class GroupConsumer:
    def __init__(self, kafka_config: dict[str, Any], group_id: str, topics: Sequence[str], *,
                 max_records: int, max_partition_fetch_bytes: int, group_instance_id: str | None = None,
                 session_timeout_ms: int = 15_000, heartbeat_interval_ms: int = 3_000):
        self.topics = list(topics)
        self.changes = _Changes()
        self.positions: dict[TP, int] = {}
        self._stash: list[Record] = []  #: records fetched while rejoining, handed out by the next poll
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
            self._end_offsets = EndOffsets(kafka_config)
        except KafkaError as exc:
            raise infrastructure_error("cannot reach Kafka", exc) from exc

    def check_topics(self, topics: Iterable[str]) -> None:
        """Fail fast when a topic is missing or hidden by ACLs (a consumer without
        DESCRIBE on a topic sees it as absent and would otherwise idle silently)."""
        for topic in topics:
            try:
                parts = self._consumer.partitions_for_topic(topic)
            except KafkaError as exc:
                raise infrastructure_error(f"cannot describe topic {topic}", exc) from exc
            if not parts:
                raise InfrastructureError(f"topic {topic} does not exist or this principal may not describe it",
                                          retriable=False)

    def subscribe(self) -> None:
        self._consumer.subscribe(self.topics, listener=self.changes)

    def poll(self, timeout_ms: int) -> list[Record]:
        if self._stash:
            records, self._stash = self._stash, []
            return records
        try:
            batches = self._consumer.poll(timeout_ms=timeout_ms)
        except KafkaError as exc:
            raise infrastructure_error("poll failed", exc) from exc
        records = [Record(r.topic, r.partition, r.offset, r.key, r.value, (r.timestamp or 0) / 1000)
                   for tp in sorted(batches, key=lambda t: (t.topic, t.partition)) for r in batches[tp]]
        return records

    def rejoin(self, timeout_s: float) -> set[TP] | None:
        """After the group moved on (a commit refused for a stale generation): drive the
        group protocol until this member has its new assignment, and return it (None on
        timeout). Records fetched meanwhile wait for the next :meth:`poll`; the
        assignment change stays in :attr:`changes` for the service to act on."""
        seen = self.changes.assignments
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._stash += self.poll(200)
            if self.changes.assignments > seen:
                return {(tp.topic, tp.partition) for tp in self._consumer.assignment()}
        return None

    def seek(self, positions: dict[TP, int]) -> None:
        """Resume partitions kept across a rebalance where this instance left off
        (an eager rebalance would otherwise rewind them to the last commit)."""
        for (topic, partition), offset in positions.items():
            try:
                self._consumer.seek(TopicPartition(topic, partition), offset)
            except (KafkaError, AssertionError) as exc:
                log.warning("cannot resume %s/%d at %d: %s", topic, partition, offset, exc)

    def forget(self, partitions: Iterable[TP]) -> None:
        for tp in partitions:
            self.positions.pop(tp, None)

    def group_metadata(self) -> Any:
        """What a transaction needs to commit this member's offsets (KIP-447)."""
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

    def lag(self, topic: str, timeout_ms: int = 5_000) -> int:
        """Records behind the end of the assigned partitions of ``topic``, asking the
        broker for the end offsets (raises when it cannot be asked)."""
        tps = [tp for tp in self._consumer.assignment() if tp.topic == topic]
        if not tps:
            return 0
        try:
            end = self._end_offsets(tps, timeout_ms=timeout_ms)
        except KafkaError as exc:
            raise infrastructure_error("cannot read end offsets", exc) from exc
        return sum(max(0, end[tp] - self.positions.get((tp.topic, tp.partition), end[tp])) for tp in tps)

    def close(self) -> None:
        self._consumer.close(autocommit=False)
        self._end_offsets.close()


