"""Reading the end of topics back: for ``triage``, and so that a new partition owner
skips outputs already written."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from monitor.broker.errors import infrastructure_error
from monitor.errors import InfrastructureError
from monitor.protocol.records import Source

TP = tuple[str, int]


def read_tail(kafka_config: dict[str, Any], topics: Iterable[str], tail: int,
              timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The last ``tail`` records of every partition of ``topics``, JSON-decoded (records
    that are not JSON objects are skipped)."""
    names = list(topics)
    out: list[dict[str, Any]] = []
    consumer = None
    try:
        # only what committed transactions wrote: an aborted batch's outputs were never written
        consumer = KafkaConsumer(enable_auto_commit=False, group_id=None, isolation_level="read_committed",
                                 **kafka_config)
        tps = [TopicPartition(t, p) for t in names for p in sorted(consumer.partitions_for_topic(t) or ())]
        if not tps:
            return out
        consumer.assign(tps)
        begin, end = consumer.beginning_offsets(tps), consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, max(begin[tp], end[tp] - tail))
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < end[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise InfrastructureError(f"timed out reading {names}", retriable=True)
            for records in consumer.poll(timeout_ms=500).values():
                for r in records:
                    try:
                        doc = json.loads(r.value or b"")
                    except ValueError:
                        continue
                    if isinstance(doc, dict):
                        out.append(doc)
    except KafkaError as exc:
        raise infrastructure_error(f"reading {names} failed", exc) from exc
    finally:
        if consumer is not None:
            consumer.close(autocommit=False)
    return out


@dataclass(frozen=True)
class Written:
    """What the committed outputs say about some partitions."""

    sources: set[Source]  #: records at or after the committed offsets whose outputs are written
    trace_ids: list[str]  #: trace ids of those partitions' outputs, oldest first


def read_back(kafka_config: dict[str, Any], topics: Iterable[str], partitions: set[TP], since: dict[TP, int],
              tail: int) -> Written:
    """The last ``tail`` committed records of each output partition, for the trace
    ``partitions`` a new owner takes: the sources at or after ``since`` (not to be written
    again) and every trace id written for them (so a trace sent again is a duplicate)."""
    sources: set[Source] = set()
    trace_ids: list[str] = []
    for doc in read_tail(kafka_config, topics, tail):
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
