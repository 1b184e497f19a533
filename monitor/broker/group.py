"""The consumer group member that reads traces and outcomes, on librdkafka
(confluent-kafka).

librdkafka fetches in its own threads, outside the interpreter lock, and calls the
rebalance callbacks from ``poll`` on the service's main thread, assigning (or
unassigning) the partitions itself. The range assignor is eager and keeps a trace and
its outcome in one instance (same partition number on both topics); ``group.instance.id``
(static membership) when given. The member never commits by itself: offsets are
committed in the output producer's transactions with :meth:`GroupMember.group_metadata`
(KIP-447). Where each partition's processing has reached is the service's business
(:mod:`monitor.service.assignment`), not the member's.

Two librdkafka settings matter here. ``fetch.queue.backoff.ms``: while its local queue
is full librdkafka waits this long before fetching again (1 s by default); the service
drains the queue in bursts, as the measuring processes free room, so it is kept short.
``queued.max.messages.kbytes`` bounds that queue to four fetches' worth, which keeps
memory flat. And ``max.poll.interval.ms`` (REBALANCE_TIMEOUT_MS) is also how long
librdkafka waits for the answer to its JoinGroup, plus 3 s: a join sent as a broker
restarts can go unanswered, and at the default (300 s) the member then stayed out of its
group for five minutes while the others went on. The service polls every
POLL_TIMEOUT_MS, less often only while it takes partitions over, which waits out a
broker outage: a member held up longer than this leaves the group and joins again at its
next poll (one rebalance more, nothing lost; the rebalance torture meets it after a
broker restart).

A librdkafka consumer that meets a fatal error never fetches again. One met here: a
static member whose session timed out in a broker outage rejoins under a new member id,
and the broker then fences its old one (``FENCED_INSTANCE_ID``). The member then starts
a new client with the same settings: its partitions are revoked and assigned again, as
in any rebalance, and kept ones resume where this instance left off. A second fatal
error within ``RENEW_WINDOW_S`` with no broker outage between them (another process with
the same group instance id, each fencing the other) stops the service; one that follows
another outage (two broker restarts a minute apart, a rolling restart) starts a new
client again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence

import confluent_kafka
from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, Message, TopicPartition
from kafka.structs import ConsumerGroupMetadata

from monitor.broker.connection import Connection
from monitor.broker.errors import from_librdkafka
from monitor.broker.librdkafka import client_error, client_log, group_metadata
from monitor.broker.offsets import Offsets
from monitor.broker.outputs import GroupMovedOn
from monitor.errors import InfrastructureError
from monitor.protocol.records import Record

log = logging.getLogger(__name__)
TP = tuple[str, int]
#: consumer errors that stop the service: the principal lost its rights
DENIED = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED,
                    KafkaError.CLUSTER_AUTHORIZATION_FAILED})
#: how long to wait for a metadata or offsets answer
ASK_TIMEOUT_S = 15.0
#: a second fatal consumer error within this long stops the service instead of starting a new client
RENEW_WINDOW_S = 300.0
#: client errors that say a broker (or all of them) could not be reached: an outage
OUTAGE = frozenset({KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN})


class Changes:
    """Assignment changes heard from the rebalance callbacks, taken by the service
    between polls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.revoked: set[TP] = set()
        #: the latest assignment heard and not revoked since (eager: each is the whole set)
        self.assigned: set[TP] | None = None
        self.assignments = 0  #: assignments received so far (an empty one counts too)

    def heard_revoked(self, revoked: Iterable[TP]) -> None:
        with self._lock:
            self.revoked |= set(revoked)
            self.assigned = None  # revoked before the service acted on it: wait for the next one

    def heard_assigned(self, assigned: Iterable[TP]) -> None:
        with self._lock:
            self.assigned = set(assigned)
            self.assignments += 1

    def take(self) -> tuple[set[TP], set[TP] | None]:
        """The partitions revoked since the last take, and the assignment heard since:
        None when none was, an empty set when this member was given no partition (more
        members than partitions: it stands by, ready)."""
        with self._lock:
            revoked, assigned = self.revoked, self.assigned
            self.revoked, self.assigned = set(), None
        return revoked, assigned


class GroupMember:
    def __init__(self, connection: Connection, group_id: str, topics: Sequence[str], *, max_records: int,
                 max_partition_fetch_bytes: int, group_instance_id: str | None = None,
                 session_timeout_ms: int = 15_000, heartbeat_interval_ms: int = 3_000,
                 rebalance_timeout_ms: int = 60_000):
        self.topics = list(topics)
        self.changes = Changes()
        self._max_records = max_records
        self._renewed_at = -RENEW_WINDOW_S
        #: the brokers were unreachable since the last new client: a fencing then follows an outage
        self._outage_since_renewal = False
        self._held: set[TP] = set()  #: what the rebalance callbacks assigned and did not revoke
        self._config = connection.librdkafka() | {
            "group.id": group_id, "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "session.timeout.ms": session_timeout_ms, "heartbeat.interval.ms": heartbeat_interval_ms,
            "max.poll.interval.ms": rebalance_timeout_ms,
            "partition.assignment.strategy": "range",
            "max.partition.fetch.bytes": max_partition_fetch_bytes, "fetch.max.bytes": 4 * max_partition_fetch_bytes,
            "queued.max.messages.kbytes": max(1, 4 * max_partition_fetch_bytes // 1024),
            "fetch.queue.backoff.ms": 5, "error_cb": self._client_error, "logger": client_log,
        }
        if group_instance_id is not None:
            self._config["group.instance.id"] = group_instance_id
        try:
            self._offsets = Offsets(connection)
            self._consumer = Consumer(self._config)
        except KafkaException as exc:
            raise from_librdkafka("cannot start the consumer", exc) from exc

    # --- the group -------------------------------------------------------------------

    def subscribe(self) -> None:
        self._consumer.subscribe(self.topics, on_assign=self._assigned, on_revoke=self._revoked,
                                 on_lost=self._revoked)

    def assignment(self) -> set[TP]:
        return {(p.topic, p.partition) for p in self._consumer.assignment()}

    @property
    def member_id(self) -> str:
        """This member's id in the group ("" before it joined)."""
        return self._consumer.memberid() or ""

    def group_metadata(self) -> ConsumerGroupMetadata:
        """What a transaction needs to commit this member's offsets (KIP-447). Raises
        :class:`GroupMovedOn` while the member has no member id for its generation (its
        session expired in a broker outage and it is rejoining): no commit can be made
        for it until it has rejoined (kafka-python refuses such metadata, ValueError)."""
        raw = self._consumer.consumer_group_metadata()
        try:
            metadata = group_metadata(raw)
        except ValueError as exc:
            raise InfrastructureError(str(exc), retriable=False) from exc
        if metadata.generation_id > 0 and not metadata.member_id:
            raise GroupMovedOn(f"this member has no member id for generation {metadata.generation_id} (it is "
                               "rejoining its group)")
        return metadata

    # --- records and offsets -----------------------------------------------------------

    def poll(self, timeout_ms: int) -> list[Record]:
        """The next records, in (topic, partition, offset) order."""
        return self._fetch(timeout_ms)

    def seek(self, positions: dict[TP, int]) -> None:
        """Resume partitions kept across a rebalance where this instance left off (an
        eager rebalance would otherwise rewind them to the last commit)."""
        for (topic, partition), offset in positions.items():
            try:
                self._consumer.seek(TopicPartition(topic, partition, offset))
            except KafkaException as exc:
                log.warning("cannot resume %s/%d at %d: %s", topic, partition, offset, exc)

    def committed(self, partitions: Iterable[TP]) -> dict[TP, int]:
        """The group's committed offsets (0 where none)."""
        asked = [TopicPartition(topic, partition) for topic, partition in partitions]
        if not asked:
            return {}
        try:
            answered = self._consumer.committed(asked, timeout=ASK_TIMEOUT_S)
        except KafkaException as exc:
            raise from_librdkafka("cannot read committed offsets", exc) from exc
        return {(p.topic, p.partition): 0 if p.offset == OFFSET_INVALID else p.offset for p in answered}

    def end_offsets(self, partitions: Iterable[TP], timeout_s: float = 5.0) -> dict[TP, int]:
        """The partitions' end offsets, asked on a connection of their own (raises when
        the broker cannot be asked)."""
        return self._offsets.end(partitions, timeout_s)

    def close(self) -> None:
        """Leave the group (a static member stays in it until its session times out)
        without committing anything."""
        self._consumer.close()
        self._offsets.close()

    # --- inside ------------------------------------------------------------------------

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
            raise from_librdkafka("poll failed", exc) from exc
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

    def _client_error(self, error: KafkaError) -> None:
        """``error_cb``: logged; an outage (no broker reachable) is remembered for :meth:`_renew`."""
        if error.code() in OUTAGE:
            self._outage_since_renewal = True
        client_error(error)

    def _renew(self, error: KafkaError) -> None:
        """Replace a client that failed for good (see the module's docstring)."""
        if time.monotonic() - self._renewed_at < RENEW_WINDOW_S and not self._outage_since_renewal:
            raise InfrastructureError(f"the consumer failed for good twice within {RENEW_WINDOW_S:.0f} s "
                                      f"(does another process use group instance id "
                                      f"{self._config.get('group.instance.id')}?): {error.str()}", retriable=False)
        self._renewed_at, self._outage_since_renewal = time.monotonic(), False
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
            raise from_librdkafka("cannot start a new consumer", exc) from exc
        self.subscribe()


def _record(m: Message) -> Record:
    _kind, stamp = m.timestamp()
    return Record(m.topic() or "", m.partition() or 0, m.offset() or 0, m.key(), m.value(), max(stamp, 0) / 1000)


def client_versions() -> dict[str, str]:
    """confluent-kafka's version and its librdkafka's, for logs and the info metric."""
    return {"version": str(confluent_kafka.__version__), "librdkafka": confluent_kafka.libversion()[0]}


