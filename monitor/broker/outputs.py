"""Writes the monitor's outputs (anomaly and dead-letter records)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kafka import KafkaProducer
from kafka.errors import KafkaError

from monitor.broker.errors import infrastructure_error
from monitor.records import Output


class OutputProducer:
    """Sends outputs with ``acks=all``; :meth:`flush` raises if any send failed."""

    def __init__(self, kafka_config: dict[str, Any]):
        try:
            self._producer = KafkaProducer(acks="all", linger_ms=5, **kafka_config)
        except KafkaError as exc:
            raise infrastructure_error("cannot create the output producer", exc) from exc
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
            raise infrastructure_error("writing outputs failed", exc) from exc

    def close(self) -> None:
        self._producer.close()


