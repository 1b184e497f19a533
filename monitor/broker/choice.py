"""The client that consumes traces (``KAFKA_CLIENT``): its group member and versions.
confluent-kafka is imported only when chosen."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from monitor.broker.member import Member

KafkaClient = Literal["confluent-kafka", "kafka-python"]


def versions(client: KafkaClient) -> dict[str, str]:
    """The chosen client's version (and librdkafka's), for logs and the info metric."""
    if client == "confluent-kafka":
        import confluent_kafka

        return {"version": str(confluent_kafka.__version__), "librdkafka": confluent_kafka.libversion()[0]}
    import kafka

    return {"version": str(kafka.__version__)}


def group_member(client: KafkaClient) -> Callable[..., Member]:
    if client == "confluent-kafka":
        from monitor.broker.rd_group import RdGroupConsumer

        return RdGroupConsumer
    from monitor.broker.group import GroupConsumer

    return GroupConsumer
