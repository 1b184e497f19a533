"""Reads a compacted topic in full into a table: every instance knows every model
contract (``attention-contracts``) and every reference decision (``attention-references``)."""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from monitor.broker.end_offsets import EndOffsets
from monitor.broker.errors import infrastructure_error
from monitor.errors import InfrastructureError

log = logging.getLogger(__name__)


class Table(Protocol):
    def apply(self, key: bytes | None, value: bytes | None) -> str | None:
        """Apply one record; its id, or None when refused."""


class TableReader:
    """Reads a compacted topic from its beginning into ``table``, then keeps up."""

    def __init__(self, kafka_config: dict[str, Any], topic: str, table: Table):
        self.table = table
        self.topic = topic
        try:
            self._consumer = KafkaConsumer(enable_auto_commit=False, group_id=None, **kafka_config)
            self._end_offsets = EndOffsets(kafka_config)
            parts = self._consumer.partitions_for_topic(topic) or set()
        except KafkaError as exc:
            raise infrastructure_error(f"cannot reach Kafka for {topic}", exc) from exc
        if not parts:
            raise InfrastructureError(f"topic {topic} does not exist or this principal may not describe it",
                                      retriable=False)
        self._tps = [TopicPartition(topic, p) for p in sorted(parts)]
        self._consumer.assign(self._tps)
        self._consumer.seek_to_beginning(*self._tps)

    def load(self, timeout_s: float) -> None:
        """Read to the end offsets as of now."""
        try:
            end = self._end_offsets(self._tps, timeout_ms=int(timeout_s * 1000))
        except KafkaError as exc:
            raise infrastructure_error(f"cannot read the end of {self.topic}", exc) from exc
        deadline = time.monotonic() + timeout_s
        while any(self._consumer.position(tp) < end[tp] for tp in self._tps):
            if time.monotonic() > deadline:
                raise InfrastructureError(f"timed out reading {self.topic}", retriable=True)
            self.refresh(500)

    def refresh(self, timeout_ms: int = 0) -> None:
        try:
            batches = self._consumer.poll(timeout_ms=timeout_ms)
        except KafkaError as exc:
            raise infrastructure_error("polling contracts failed", exc) from exc
        for records in batches.values():
            for r in records:
                if self.table.apply(r.key, r.value) is None:
                    log.warning("refused record %s/%d@%d", r.topic, r.partition, r.offset)

    def close(self) -> None:
        self._consumer.close(autocommit=False)
        self._end_offsets.close()


