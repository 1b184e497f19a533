"""Administration: creating the monitor's topics (``attention-monitor topics create``,
``make kafka``) and reference decisions (``attention-monitor reference …``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kafka import KafkaAdminClient, KafkaProducer
from kafka.errors import KafkaError, TopicAlreadyExistsError, for_code

from monitor.broker.errors import infrastructure_error
from monitor.broker.tables import TableReader
from monitor.errors import InfrastructureError
from monitor.protocol.decisions import ReferenceDecision, ReferenceTable
from monitor.protocol.topics import TopicSpec

CREATED, EXISTS = "created", "exists"


def create_topics(kafka_config: dict[str, Any], specs: Iterable[TopicSpec], replication_factor: int = -1,
                  timeout_s: float = 30.0) -> dict[str, str]:
    """Create every topic that does not exist yet; returns ``created`` or ``exists`` per
    name. A replication factor of -1 takes the broker's ``default.replication.factor``."""
    wanted = {spec.name: {"num_partitions": spec.partitions, "replication_factor": replication_factor,
                          "configs": dict(spec.configs)} for spec in specs}
    admin = None
    try:
        admin = KafkaAdminClient(request_timeout_ms=int(timeout_s * 1000), **kafka_config)
        response = admin.create_topics(wanted, timeout_ms=int(timeout_s * 1000), raise_errors=False)
        done: dict[str, str] = {}
        for topic in response["topics"]:
            error = for_code(topic["error_code"])
            if topic["error_code"] == 0:
                done[topic["name"]] = CREATED
            elif error is TopicAlreadyExistsError:
                done[topic["name"]] = EXISTS
            else:
                raise InfrastructureError(f"cannot create topic {topic['name']}: {error.__name__}: "
                                          f"{topic.get('error_message') or ''}".rstrip(": "), retriable=False)
        created = [name for name, state in done.items() if state == CREATED]
        if created:
            admin.wait_for_topics(created)
        return done
    except KafkaError as exc:
        raise infrastructure_error("creating topics failed", exc) from exc
    finally:
        if admin is not None:
            admin.close()


def publish_decision(kafka_config: dict[str, Any], topic: str, decision: ReferenceDecision,
                     timeout_s: float = 30.0) -> None:
    """Publish a reference decision and wait until the broker has it."""
    producer = None
    try:
        producer = KafkaProducer(acks="all", **kafka_config)
        key, value = decision.record()
        producer.send(topic, key=key, value=value).get(timeout=timeout_s)
    except KafkaError as exc:
        raise infrastructure_error(f"publishing to {topic} failed", exc) from exc
    finally:
        if producer is not None:
            producer.close()


def read_decisions(kafka_config: dict[str, Any], topic: str, timeout_s: float = 30.0) -> ReferenceTable:
    """Every reference decision on the topic, the latest per revision."""
    table = ReferenceTable()
    reader = TableReader(kafka_config, topic, table)
    try:
        reader.load(timeout_s)
    finally:
        reader.close()
    return table
