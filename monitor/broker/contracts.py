"""Reads the compacted contracts topic in full: every instance knows every contract."""

from __future__ import annotations

import logging
import time
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from monitor.broker.errors import infrastructure_error
from monitor.errors import InfrastructureError
from monitor.model_contract import ContractTable

log = logging.getLogger(__name__)


class ContractReader:
    """Reads the compacted contracts topic in full into a :class:`ContractTable`."""

    def __init__(self, kafka_config: dict[str, Any], topic: str, table: ContractTable):
        self.table = table
        try:
            self._consumer = KafkaConsumer(enable_auto_commit=False, group_id=None, **kafka_config)
            parts = self._consumer.partitions_for_topic(topic) or set()
        except KafkaError as exc:
            raise infrastructure_error("cannot reach Kafka for contracts", exc) from exc
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
            raise infrastructure_error("polling contracts failed", exc) from exc
        for records in batches.values():
            for r in records:
                if self.table.apply(r.key, r.value) is None:
                    log.warning("refused contract record %s/%d@%d", r.topic, r.partition, r.offset)

    def close(self) -> None:
        self._consumer.close(autocommit=False)


