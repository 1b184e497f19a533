"""What the service asks of a consumer group member, whichever Kafka client runs it.

The service polls, learns of assignment changes between polls (:class:`Changes`),
resumes kept partitions where it left off (``seek``), commits offsets only through the
output producer's transaction with the member's ``group_metadata()`` (KIP-447), and
after the group moved on drives a rejoin. ``positions`` is the next offset the service
has finished per owned partition, kept by the service itself.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from kafka import TopicPartition
from kafka.errors import KafkaError

from monitor.broker.end_offsets import EndOffsets
from monitor.broker.errors import infrastructure_error
from monitor.protocol.records import Record

TP = tuple[str, int]


class Changes:
    """Assignment changes heard from the client, taken by the service between polls.
    The kafka-python client reports them from its IO thread, hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.revoked: set[TP] = set()
        self.assigned: set[TP] = set()
        self.assignments = 0  #: assignments received so far (an empty one counts too)

    def heard_revoked(self, revoked: Iterable[TP]) -> None:
        with self._lock:
            self.revoked |= set(revoked)

    def heard_assigned(self, assigned: Iterable[TP]) -> None:
        with self._lock:
            self.assigned |= set(assigned)
            self.assignments += 1

    def take(self) -> tuple[set[TP], set[TP]]:
        with self._lock:
            revoked, assigned = self.revoked, self.assigned
            self.revoked, self.assigned = set(), set()
        return revoked, assigned


class Member(ABC):
    """A group member; :class:`~monitor.broker.group.GroupConsumer` (kafka-python) and
    :class:`~monitor.broker.rd_group.RdGroupConsumer` (librdkafka) fill in the client."""

    def __init__(self, kafka_config: dict[str, Any], topics: Iterable[str]) -> None:
        self.topics = list(topics)
        self.changes = Changes()
        self.positions: dict[TP, int] = {}
        self._stash: list[Record] = []  #: records fetched while rejoining, handed out by the next poll
        try:
            self._end_offsets = EndOffsets(kafka_config)
        except KafkaError as exc:
            raise infrastructure_error("cannot reach Kafka", exc) from exc

    def poll(self, timeout_ms: int) -> list[Record]:
        """The next records, in (topic, partition, offset) order."""
        if self._stash:
            records, self._stash = self._stash, []
            return records
        return self._fetch(timeout_ms)

    def rejoin(self, timeout_s: float) -> set[TP] | None:
        """After the group moved on (a commit refused for a stale generation): drive the
        group protocol until this member has its new assignment, and return it (None on
        timeout). Records fetched meanwhile wait for the next :meth:`poll`; the
        assignment change stays in :attr:`changes` for the service to act on."""
        seen = self.changes.assignments
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._stash += self._fetch(200)
            if self.changes.assignments > seen:
                return self.assignment()
        return None

    def forget(self, partitions: Iterable[TP]) -> None:
        for tp in partitions:
            self.positions.pop(tp, None)

    @abstractmethod
    def _fetch(self, timeout_ms: int) -> list[Record]: ...

    @abstractmethod
    def assignment(self) -> set[TP]: ...

    @abstractmethod
    def check_topics(self, topics: Iterable[str]) -> None:
        """Fail fast when a topic is missing or hidden by ACLs (a consumer without
        DESCRIBE on a topic sees it as absent and would otherwise idle silently)."""

    @abstractmethod
    def subscribe(self) -> None: ...

    @abstractmethod
    def seek(self, positions: dict[TP, int]) -> None:
        """Resume partitions kept across a rebalance where this instance left off (an
        eager rebalance would otherwise rewind them to the last commit)."""

    @abstractmethod
    def group_metadata(self) -> Any:
        """What a transaction needs to commit this member's offsets (KIP-447)."""

    @abstractmethod
    def committed(self, partitions: Iterable[TP]) -> dict[TP, int]:
        """The group's committed offsets (0 where none)."""

    def lag(self, topic: str, timeout_ms: int = 5_000) -> int:
        """Records behind the end of the assigned partitions of ``topic``, asking the
        broker for the end offsets (raises when it cannot be asked)."""
        tps = [TopicPartition(t, p) for t, p in self.assignment() if t == topic]
        if not tps:
            return 0
        try:
            end = self._end_offsets(tps, timeout_ms=timeout_ms)
        except KafkaError as exc:
            raise infrastructure_error("cannot read end offsets", exc) from exc
        return sum(max(0, end[tp] - self.positions.get((tp.topic, tp.partition), end[tp])) for tp in tps)

    def close(self) -> None:
        self._close_client()
        self._end_offsets.close()

    @abstractmethod
    def _close_client(self) -> None:
        """Leave the group (a static member stays in it until its session times out)
        without committing anything."""
