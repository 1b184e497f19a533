"""Settings and errors of librdkafka clients (confluent-kafka), from the service's
kafka-python connection settings.

The service consumes traces and writes its outputs with librdkafka by default
(``KAFKA_CLIENT``): kafka-python parses every fetched record in the interpreter, about
0.2 ms of CPU for a 129 KiB trace on the service bench, where librdkafka spends about
0.06 ms in its own threads, outside the interpreter lock. Everything else (the tables,
end offsets, the admin verbs, the model servers' producer) stays on kafka-python.
"""

from __future__ import annotations

from typing import Any

from confluent_kafka import KafkaError, KafkaException

from monitor.errors import InfrastructureError

#: kafka-python connection settings and their librdkafka names
_NAMES = {"security_protocol": "security.protocol", "sasl_mechanism": "sasl.mechanism",
          "sasl_plain_username": "sasl.username", "sasl_plain_password": "sasl.password",
          "client_id": "client.id"}


def librdkafka_config(kafka_config: dict[str, Any]) -> dict[str, Any]:
    """The connection settings of ``Settings.kafka_config()`` in librdkafka's words
    (anything else there is a mistake: it raises ``KeyError``)."""
    servers = kafka_config["bootstrap_servers"]
    config: dict[str, Any] = {"bootstrap.servers": servers if isinstance(servers, str) else ",".join(servers)}
    for name, value in kafka_config.items():
        if name != "bootstrap_servers":
            config[_NAMES[name]] = value
    return config


def error_of(exc: KafkaException) -> KafkaError | None:
    error = exc.args[0] if exc.args else None
    return error if isinstance(error, KafkaError) else None


def rd_infrastructure_error(action: str, exc: KafkaException) -> InfrastructureError:
    """``exc`` from confluent-kafka, keeping its ``retriable`` flag."""
    error = error_of(exc)
    retriable = error is not None and bool(error.retriable()) and not error.fatal()
    detail = f"{error.name()}: {error.str()}" if error is not None else str(exc)
    return InfrastructureError(f"{action}: {detail}", retriable=retriable)
