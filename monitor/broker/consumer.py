"""Consuming: the group member, the contracts table reader, the output producer, and
the read-back that lets a new partition owner skip outputs already written.

The verbs are Kafka's: ``subscribe``, ``poll``, ``commit``, ``close``. kafka-python 3.0
runs rebalance listeners on its IO thread, so the listener here blocks on nothing: it
records what changed, and the service acts on it between polls. Commits are always
synchronous, from the service's own thread, after a batch's outputs are flushed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, OffsetAndMetadata, TopicPartition
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.errors import (
    CommitFailedError,
    IllegalGenerationError,
    KafkaError,
    RebalanceInProgressError,
    UnknownMemberIdError,
)

from monitor.errors import InfrastructureError
from monitor.model_contract import ContractTable
from monitor.pipeline import Output, Record

log = logging.getLogger(__name__)
TP = tuple[str, int]


def _infra(action: str, exc: Exception) -> InfrastructureError:
    retriable = bool(getattr(exc, "retriable", False))
    return InfrastructureError(f"{action}: {type(exc).__name__}: {exc}", retriable=retriable)


class _Changes(ConsumerRebalanceListener):
    """Remembers assignment changes; runs on kafka-python's IO thread, so it only records."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.revoked: set[TP] = set()
        self.assigned: set[TP] = set()

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        with self._lock:
            self.revoked |= {(tp.topic, tp.partition) for tp in revoked}

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        with self._lock:
            self.assigned |= {(tp.topic, tp.partition) for tp in assigned}

    def take(self) -> tuple[set[TP], set[TP]]:
        with self._lock:
            revoked, assigned = self.revoked, self.assigned
            self.revoked, self.assigned = set(), set()
        return revoked, assigned


class GroupConsumer:
    def __init__(self, kafka_config: dict[str, Any], group_id: str, topics: Sequence[str], *,
                 max_records: int, max_partition_fetch_bytes: int):
        self.topics = list(topics)
        self.changes = _Changes()
        self.positions: dict[TP, int] = {}
        try:
            self._consumer = KafkaConsumer(
                group_id=group_id, enable_auto_commit=False, auto_offset_reset="earliest",
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
            raise _infra("cannot reach Kafka", exc) from exc

    def check_topics(self, topics: Iterable[str]) -> None:
        """Fail fast when a topic is missing or hidden by ACLs (a consumer without
        DESCRIBE on a topic sees it as absent and would otherwise idle silently)."""
        for topic in topics:
            try:
                parts = self._consumer.partitions_for_topic(topic)
            except KafkaError as exc:
                raise _infra(f"cannot describe topic {topic}", exc) from exc
            if not parts:
                raise InfrastructureError(f"topic {topic} does not exist or this principal may not describe it",
                                          retriable=False)

    def subscribe(self) -> None:
        self._consumer.subscribe(self.topics, listener=self.changes)

    def poll(self, timeout_ms: int) -> list[Record]:
        try:
            batches = self._consumer.poll(timeout_ms=timeout_ms)
        except KafkaError as exc:
            raise _infra("poll failed", exc) from exc
        records = [Record(r.topic, r.partition, r.offset, r.key, r.value)
                   for tp in sorted(batches, key=lambda t: (t.topic, t.partition)) for r in batches[tp]]
        return records

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

    def commit(self, offsets: dict[TP, int]) -> None:
        if not offsets:
            return
        payload = {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()}
        try:
            self._consumer.commit(payload)
        except (CommitFailedError, RebalanceInProgressError, IllegalGenerationError, UnknownMemberIdError) as exc:
            # The group moved on: these partitions are being reassigned and their new
            # owner resumes from the previous commit. Nothing is lost; skip this commit.
            log.warning("commit skipped during a rebalance: %s", type(exc).__name__)
        except KafkaError as exc:
            raise _infra("commit failed", exc) from exc

    def committed(self, partitions: Iterable[TP]) -> dict[TP, int]:
        out = {}
        for topic, partition in partitions:
            try:
                offset = self._consumer.committed(TopicPartition(topic, partition))
            except KafkaError as exc:
                raise _infra("cannot read committed offsets", exc) from exc
            out[(topic, partition)] = offset or 0
        return out

    def lag(self, topic: str) -> int:
        total = 0
        for tp in self._consumer.assignment():
            if tp.topic != topic:
                continue
            high = self._consumer.highwater(tp)
            if high is not None:
                total += max(0, high - self.positions.get((tp.topic, tp.partition), high))
        return total

    def close(self) -> None:
        self._consumer.close(autocommit=False)


class ContractReader:
    """Reads the compacted contracts topic in full into a :class:`ContractTable`."""

    def __init__(self, kafka_config: dict[str, Any], topic: str, table: ContractTable):
        self.table = table
        try:
            self._consumer = KafkaConsumer(enable_auto_commit=False, group_id=None, **kafka_config)
            parts = self._consumer.partitions_for_topic(topic) or set()
        except KafkaError as exc:
            raise _infra("cannot reach Kafka for contracts", exc) from exc
        if not parts:
            raise InfrastructureError(f"topic {topic} does not exist or this principal may not describe it",
                                      retriable=False)
        self._tps = [TopicPartition(topic, p) for p in sorted(parts)]
        self._consumer.assign(self._tps)
        self._consumer.seek_to_beginning(*self._tps)

    def load(self, timeout_s: float) -> int:
        """Read to the end offsets as of now; returns how many contracts are known."""
        end = self._consumer.end_offsets(self._tps)
        deadline = time.monotonic() + timeout_s
        while any(self._consumer.position(tp) < end[tp] for tp in self._tps):
            if time.monotonic() > deadline:
                raise InfrastructureError("timed out reading the contracts topic", retriable=True)
            self.refresh(500)
        return len(self.table)

    def refresh(self, timeout_ms: int = 0) -> None:
        try:
            batches = self._consumer.poll(timeout_ms=timeout_ms)
        except KafkaError as exc:
            raise _infra("polling contracts failed", exc) from exc
        for records in batches.values():
            for r in records:
                if self.table.apply(r.key, r.value) is None:
                    log.warning("refused contract record %s/%d@%d", r.topic, r.partition, r.offset)

    def close(self) -> None:
        self._consumer.close(autocommit=False)


class OutputProducer:
    """Sends outputs with ``acks=all``; :meth:`flush` raises if any send failed."""

    def __init__(self, kafka_config: dict[str, Any]):
        try:
            self._producer = KafkaProducer(acks="all", linger_ms=5, **kafka_config)
        except KafkaError as exc:
            raise _infra("cannot create the output producer", exc) from exc
        self._futures: list[Any] = []

    def send(self, outputs: Iterable[Output]) -> None:
        for out in outputs:
            self._futures.append(self._producer.send(out.topic, key=out.key, value=out.value))

    def flush(self, timeout_s: float = 30.0) -> None:
        futures, self._futures = self._futures, []
        try:
            self._producer.flush(timeout_s)
            for future in futures:
                future.get(timeout=timeout_s)
        except KafkaError as exc:
            raise _infra("writing outputs failed", exc) from exc

    def close(self) -> None:
        self._producer.close()


def read_tail(kafka_config: dict[str, Any], topics: Iterable[str], tail: int,
              timeout_s: float = 30.0) -> list[Any]:
    """The last ``tail`` records of every partition of ``topics``, JSON-decoded (records
    that are not JSON objects are skipped)."""
    out: list[Any] = []
    consumer = KafkaConsumer(enable_auto_commit=False, group_id=None, **kafka_config)
    try:
        tps = [TopicPartition(t, p) for t in topics for p in sorted(consumer.partitions_for_topic(t) or ())]
        if not tps:
            return out
        consumer.assign(tps)
        begin, end = consumer.beginning_offsets(tps), consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, max(begin[tp], end[tp] - tail))
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < end[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise InfrastructureError(f"timed out reading {list(topics)}", retriable=True)
            for records in consumer.poll(timeout_ms=500).values():
                for r in records:
                    try:
                        doc = json.loads(r.value or b"")
                    except ValueError:
                        continue
                    if isinstance(doc, dict):
                        out.append(doc)
    except KafkaError as exc:
        raise _infra(f"reading {list(topics)} failed", exc) from exc
    finally:
        consumer.close(autocommit=False)
    return out


def emitted_sources(kafka_config: dict[str, Any], topics: Iterable[str], partitions: set[TP],
                    since: dict[TP, int], tail: int) -> set[tuple[str, int, int]]:
    """Sources (topic, partition, offset) of outputs already written for ``partitions``
    at or after ``since``, found in the last ``tail`` records of each output partition."""
    found = set()
    for doc in read_tail(kafka_config, topics, tail):
        source = _source(doc)
        if source and (source[0], source[1]) in partitions and source[2] >= since.get(source[:2], 0):
            found.add(source)
    return found


def _source(doc: dict[str, Any]) -> tuple[str, int, int] | None:
    try:
        s = doc["source"]
        return str(s["topic"]), int(s["partition"]), int(s["offset"])
    except (KeyError, TypeError, ValueError):
        return None
