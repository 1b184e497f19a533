"""The producer model-server teams use to publish signed traces.

    from monitor.broker.producer import TraceProducer

    with TraceProducer(bootstrap_servers="kafka:9092", key_id="team-a", secret=b"...") as producer:
        producer.send(header, weights)       # key = header.request_id

Large traces need the limits raised together: the topic's ``max.message.bytes``, the
broker's ``message.max.bytes`` and this producer's ``max_request_size`` (default here
16 MiB + headroom, matching the monitor's default record limit).
"""

from __future__ import annotations

import json
from types import TracebackType
from typing import Any

import numpy as np
from kafka import KafkaProducer
from numpy.typing import NDArray

from monitor.codec import encode
from monitor.contract import TraceHeader

DEFAULT_TOPIC = "attention-traces"


class TraceProducer:
    """Encodes, signs and sends traces; extra keyword arguments go to ``KafkaProducer``."""

    def __init__(self, *, key_id: str, secret: bytes, topic: str = DEFAULT_TOPIC, **kafka_config: Any):
        self.topic = topic
        self._key_id = key_id
        self._secret = secret
        kafka_config.setdefault("max_request_size", 16 * 1024 * 1024 + 64 * 1024)
        kafka_config.setdefault("linger_ms", 5)
        self._producer = KafkaProducer(**kafka_config)

    def send(self, header: TraceHeader, weights: NDArray[np.generic]) -> Any:
        """Queue one trace; returns kafka-python's future of its record metadata."""
        value = encode(header, weights, self._key_id, self._secret)
        return self._producer.send(self.topic, key=header.request_id.encode(), value=value)

    def flush(self, timeout: float | None = None) -> None:
        self._producer.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        self._producer.close(timeout)

    def __enter__(self) -> TraceProducer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.flush()
        self.close()


def publish_contract(producer: KafkaProducer, topic: str, contract: Any) -> None:
    """Publish a model contract on the compacted contracts topic, keyed by its id."""
    from monitor.model_contract import ContractTable

    key, value = ContractTable.record(contract)
    producer.send(topic, key=key, value=value)


def send_outcome(producer: KafkaProducer, topic: str, request_id: str, outcome: str, timestamp: float) -> None:
    """Publish a task outcome (``success`` or ``failure``), keyed by request id."""
    value = json.dumps({"request_id": request_id, "outcome": outcome, "timestamp": timestamp}).encode()
    producer.send(topic, key=request_id.encode(), value=value)
