"""Kafka client errors as the monitor's :class:`~monitor.errors.InfrastructureError`,
keeping each client's own ``retriable`` flag, and for librdkafka also the codes of
:data:`TRANSIENT` (librdkafka leaves the flag unset on most broker errors, so a broker
restart would otherwise read as a permanent failure)."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException

from monitor.errors import InfrastructureError

#: librdkafka error codes that a broker restart, a leader moving or a slow broker give,
#: and that go away by themselves: retriable whatever the error's own flag says
TRANSIENT = frozenset({
    KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT, KafkaError._MSG_TIMED_OUT,
    KafkaError._WAIT_COORD, KafkaError._RESOLVE, KafkaError.REQUEST_TIMED_OUT, KafkaError.NETWORK_EXCEPTION,
    KafkaError.LEADER_NOT_AVAILABLE, KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.FENCED_LEADER_EPOCH,
    KafkaError.UNKNOWN_LEADER_EPOCH, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.NOT_COORDINATOR, KafkaError.NOT_ENOUGH_REPLICAS,
    KafkaError.OFFSET_NOT_AVAILABLE,
})


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
    retriable = bool(error.retriable()) or error.code() in TRANSIENT
    return InfrastructureError(f"{action}: {error.name()}: {error.str()}", retriable=retriable and not error.fatal())
