"""Administration: creating the monitor's topics (``attention-monitor topics create``,
``make kafka``) and reference decisions (``attention-monitor reference …``)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from monitor.broker.connection import Connection
from monitor.broker.errors import from_librdkafka
from monitor.broker.librdkafka import client_error, client_log
from monitor.broker.tables import TableReader
from monitor.errors import InfrastructureError
from monitor.protocol.decisions import ReferenceDecision, ReferenceTable
from monitor.protocol.topics import TopicSpec

CREATED, EXISTS = "created", "exists"


def admin_client(connection: Connection) -> AdminClient:
    return AdminClient(connection.librdkafka() | {"error_cb": client_error, "logger": client_log})


def create_topics(connection: Connection, specs: Iterable[TopicSpec], replication_factor: int = -1,
                  timeout_s: float = 30.0) -> dict[str, str]:
    """Create every topic that does not exist yet; returns ``created`` or ``exists`` per
    name, once every created topic has a leader for each partition. A replication factor
    of -1 takes the broker's ``default.replication.factor``."""
    wanted = [NewTopic(spec.name, num_partitions=spec.partitions, replication_factor=replication_factor,
                       config=dict(spec.configs)) for spec in specs]
    admin = admin_client(connection)
    done: dict[str, str] = {}
    try:
        for name, future in admin.create_topics(wanted, request_timeout=timeout_s).items():
            try:
                future.result(timeout=timeout_s + 5)
                done[name] = CREATED
            except KafkaException as exc:
                error = exc.args[0]
                if isinstance(error, KafkaError) and error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    done[name] = EXISTS
                    continue
                raise InfrastructureError(f"cannot create topic {name}: {error.name()}: {error.str()}"
                                          if isinstance(error, KafkaError) else f"cannot create topic {name}: {exc}",
                                          retriable=False) from exc
        _wait_for_leaders(admin, [name for name, state in done.items() if state == CREATED], timeout_s)
        return done
    except KafkaException as exc:
        raise from_librdkafka("creating topics failed", exc) from exc


def partition_counts(connection: Connection, topics: Iterable[str], timeout_s: float = 15.0
                     ) -> dict[str, int | None]:
    """Each of ``topics``' partition counts as this principal sees the cluster; None for
    a topic that does not exist or that it may not describe (without DESCRIBE a topic
    looks absent). One metadata request for the whole cluster: asking for a topic by name
    could create it on a broker that creates topics on demand."""
    try:
        found = admin_client(connection).list_topics(timeout=timeout_s).topics
    except KafkaException as exc:
        raise from_librdkafka("cannot describe the topics", exc) from exc
    counts: dict[str, int | None] = {}
    for topic in topics:
        meta = found.get(topic)
        counts[topic] = len(meta.partitions) if meta is not None and meta.error is None and meta.partitions else None
    return counts


def _wait_for_leaders(admin: AdminClient, topics: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for topic in topics:
        while True:
            found = admin.list_topics(topic, timeout=timeout_s).topics.get(topic)
            if found is not None and found.error is None and found.partitions and all(
                    p.leader >= 0 for p in found.partitions.values()):
                break
            if time.monotonic() > deadline:
                raise InfrastructureError(f"topic {topic} was created but has no leader yet", retriable=True)
            time.sleep(0.1)


def publish_decision(connection: Connection, topic: str, decision: ReferenceDecision, timeout_s: float = 30.0) -> None:
    """Publish a reference decision and wait until the broker has it."""
    failed: list[KafkaError] = []
    delivered: list[bool] = []

    def report(error: KafkaError | None, _message: object) -> None:
        (failed.append(error) if error is not None else delivered.append(True))

    producer = Producer(connection.librdkafka() | {"acks": "all", "enable.idempotence": True,
                                                   "error_cb": client_error, "logger": client_log,
                                                   "message.timeout.ms": int(timeout_s * 1000)})
    key, value = decision.record()
    try:
        producer.produce(topic, key=key, value=value, on_delivery=report)
        producer.flush(timeout_s + 5)
    except KafkaException as exc:
        raise from_librdkafka(f"publishing to {topic} failed", exc) from exc
    if failed:
        raise from_librdkafka(f"publishing to {topic} failed", failed[0])
    if not delivered:
        raise InfrastructureError(f"publishing to {topic}: no acknowledgement within {timeout_s:.0f} s",
                                  retriable=True)


def read_decisions(connection: Connection, topic: str, timeout_s: float = 30.0) -> ReferenceTable:
    """Every reference decision on the topic, the latest per revision."""
    table = ReferenceTable()
    reader = TableReader(connection, topic, table)
    try:
        reader.load(timeout_s)
    finally:
        reader.close()
    return table
