"""Kafka client errors as the monitor's :class:`~monitor.errors.InfrastructureError`,
keeping each client's own ``retriable`` flag."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException

from monitor.errors import InfrastructureError


def from_kafka_python(action: str, exc: Exception) -> InfrastructureError:
    """``exc`` from kafka-python (the output and model-server producers)."""
    retriable = bool(getattr(exc, "retriable", False))
    return InfrastructureError(f"{action}: {type(exc).__name__}: {exc}", retriable=retriable)


def from_librdkafka(action: str, exc: KafkaException | KafkaError) -> InfrastructureError:
    """``exc`` from confluent-kafka (every consuming and administering client); a fatal
    error is never retriable."""
    error = exc if isinstance(exc, KafkaError) else exc.args[0] if exc.args else None
    if not isinstance(error, KafkaError):
        return InfrastructureError(f"{action}: {exc}", retriable=False)
    return InfrastructureError(f"{action}: {error.name()}: {error.str()}",
                               retriable=bool(error.retriable()) and not error.fatal())
