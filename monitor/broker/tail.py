"""Reading the end of topics back: for ``triage`` and ``status``, and so that a new
partition owner skips outputs already written.

Only what committed transactions wrote is read (``read_committed``): an aborted batch's
outputs were never written.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from monitor.broker.connection import Connection
from monitor.broker.errors import from_librdkafka
from monitor.broker.offsets import Offsets
from monitor.broker.tables import reader_config
from monitor.errors import InfrastructureError, TraceRejected
from monitor.protocol import observations
from monitor.protocol.records import Source

TP = tuple[str, int]


def read_tail(connection: Connection, topics: Iterable[str], tail: int,
              timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The committed records among the last ``tail`` offsets of every partition of
    ``topics`` (transaction markers take offsets too), JSON-decoded (records that are
    not JSON objects are skipped; an observations record gives its traces' identities)."""
    names = list(topics)
    out: list[dict[str, Any]] = []
    consumer = None
    try:
        consumer = Consumer(reader_config(connection, **{"isolation.level": "read_committed",
                                                         "enable.partition.eof": True}))
        partitions = []
        for topic in names:
            found = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
            if found is not None and found.error is None:
                partitions += [(topic, p) for p in sorted(found.partitions)]
        if not partitions:
            return out
        offsets = Offsets(connection)
        end, begin = offsets.end(partitions, timeout_s, committed=True), offsets.beginning(partitions, timeout_s)
        waiting = {tp for tp in partitions if end[tp] > begin[tp]}
        consumer.assign([TopicPartition(t, p, max(begin[(t, p)], end[(t, p)] - tail)) for t, p in partitions])
        deadline = time.monotonic() + timeout_s
        while waiting:
            if time.monotonic() > deadline:
                raise InfrastructureError(f"timed out reading {names}", retriable=True)
            for m in consumer.consume(500, 0.5):
                tp = (m.topic() or "", m.partition() or 0)
                error = m.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        waiting.discard(tp)
                    elif error.fatal():
                        raise from_librdkafka(f"reading {names} failed", error)
                    continue
                if (m.offset() or 0) + 1 >= end[tp]:
                    waiting.discard(tp)
                value = m.value() or b""
                if value.startswith(observations.MAGIC):  # a judge's record: its traces' identities
                    with contextlib.suppress(TraceRejected):
                        out += [entry.identity.fields() for entry in observations.decode(value)]
                    continue
                try:
                    doc = json.loads(value)
                except ValueError:
                    continue
                if isinstance(doc, dict):
                    out.append(doc)
    except KafkaException as exc:
        raise from_librdkafka(f"reading {names} failed", exc) from exc
    finally:
        if consumer is not None:
            consumer.close()
    return out


def read_range(connection: Connection, topic: str, partition: int, start: int | None, end: int | None,
               timeout_s: float = 60.0) -> list[tuple[int, bytes | None, bytes | None]]:
    """(offset, key, value) of the committed records of one partition from ``start`` (None:
    its beginning) up to ``end`` (None: its end now), in order: what a new owner of a
    judge's observations partition reads back)."""
    tp = (topic, partition)
    out: list[tuple[int, bytes | None, bytes | None]] = []
    consumer = None
    offsets = Offsets(connection)
    try:
        last = offsets.end([tp], timeout_s, committed=True)[tp] if end is None else end
        first = offsets.beginning([tp], timeout_s)[tp] if start is None else start
        if first >= last:
            return out
        consumer = Consumer(reader_config(connection, **{"isolation.level": "read_committed",
                                                         "enable.partition.eof": True}))
        consumer.assign([TopicPartition(topic, partition, first)])
        deadline = time.monotonic() + timeout_s
        while True:
            if time.monotonic() > deadline:
                raise InfrastructureError(f"timed out reading {topic}/{partition} from {first} to {last}",
                                          retriable=True)
            for m in consumer.consume(500, 0.5):
                error = m.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        return out
                    if error.fatal():
                        raise from_librdkafka(f"reading {topic}/{partition} failed", error)
                    continue
                offset = m.offset() or 0
                if offset >= last:
                    return out
                out.append((offset, m.key(), m.value()))
                if offset + 1 >= last:
                    return out
    except KafkaException as exc:
        raise from_librdkafka(f"reading {topic}/{partition} failed", exc) from exc
    finally:
        offsets.close()
        if consumer is not None:
            consumer.close()


def is_committed(connection: Connection, topic: str, partition: int, offset: int, timeout_s: float = 60.0) -> bool:
    """Whether the record written at ``offset`` belongs to a committed transaction (an
    aborted one's records are invisible to ``read_committed``): asked once the
    transaction has ended, and its partition's last stable offset is past the record
    (another producer's transaction begun before it may hold that back); raises
    :class:`InfrastructureError` (retriable) when it is not within ``timeout_s``."""
    offsets = Offsets(connection)
    deadline = time.monotonic() + timeout_s
    try:
        while offsets.end([(topic, partition)], timeout_s, committed=True)[(topic, partition)] <= offset:
            if time.monotonic() > deadline:
                raise InfrastructureError(f"{topic}/{partition}: the transactions before offset {offset} did not end "
                                          f"within {timeout_s:.0f} s", retriable=True)
            time.sleep(0.2)
    finally:
        offsets.close()
    return any(at == offset for at, _, _ in read_range(connection, topic, partition, offset, offset + 1, timeout_s))


@dataclass(frozen=True)
class Written:
    """What the committed outputs say about some partitions."""

    sources: set[Source]  #: records at or after the committed offsets whose outputs are written
    trace_ids: list[str]  #: trace ids of those partitions' outputs, oldest first


def read_back(connection: Connection, topics: Iterable[str], partitions: set[TP], since: dict[TP, int],
              tail: int) -> Written:
    """The committed records among the last ``tail`` offsets of each output partition, for the trace
    ``partitions`` a new owner takes: the sources at or after ``since`` (not to be written
    again) and every trace id written for them (so a trace sent again is a duplicate)."""
    sources: set[Source] = set()
    trace_ids: list[str] = []
    for doc in read_tail(connection, topics, tail):
        source = _source(doc)
        if not source or (source[0], source[1]) not in partitions:
            continue
        if source[2] >= since.get(source[:2], 0):
            sources.add(source)
        trace_id = doc.get("trace_id") or (doc.get("verified_header") or {}).get("trace_id")
        if isinstance(trace_id, str):
            trace_ids.append(trace_id)
    return Written(sources, trace_ids)


def _source(doc: dict[str, Any]) -> Source | None:
    try:
        s = doc["source"]
        return str(s["topic"]), int(s["partition"]), int(s["offset"])
    except (KeyError, TypeError, ValueError):
        return None
