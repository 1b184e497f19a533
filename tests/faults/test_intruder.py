"""A principal without ACLs against the secured broker (the SCRAM profile, the same
security as docker-compose.yml's): it can neither read traces, write anomalies, nor
grant itself ACLs through either listener. The first release's controller listener let
any local process grant itself ALL through Kafka's Admin API (KIP-919)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import GroupAuthorizationFailedError, KafkaError, TopicAuthorizationFailedError

from devstack.kafka import ADMIN_PASSWORD, ADMIN_USER, classpath, create_scram_user, java
from tests.service.harness import make_topics

pytestmark = [pytest.mark.kafka, pytest.mark.faults]
GRANT_ACL = Path(__file__).resolve().parents[1] / "data" / "GrantAcl.java"


def grant_everything(*props: str) -> str:
    """Kafka's own Java Admin client trying to grant User:intruder ALL on every topic."""
    out = subprocess.run([java(), "-cp", classpath(), str(GRANT_ACL), *props], capture_output=True, text=True,
                         timeout=120, check=False)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:]


def test_a_principal_without_acls_can_read_write_and_grant_nothing_through_any_listener(
        scram_broker, scram_admin, make_scram_topic, unique_name):
    topics = make_topics(make_scram_topic)
    send = KafkaProducer(**scram_broker.client_config(), linger_ms=0)
    send.send(topics.traces, key=b"r", value=b"a trace").get(timeout=30)
    send.close()
    create_scram_user(scram_admin, "intruder", "intruder-password")
    intruder = scram_broker.client_config("intruder", "intruder-password")

    consumer = KafkaConsumer(topics.traces, group_id=unique_name("group"), auto_offset_reset="earliest",
                             consumer_timeout_ms=5000, **intruder)
    with pytest.raises((GroupAuthorizationFailedError, TopicAuthorizationFailedError)):
        list(consumer)
    consumer.close()
    producer = KafkaProducer(**intruder, max_block_ms=10_000)
    with pytest.raises(KafkaError):  # TopicAuthorizationFailedError, or the idempotent producer refused first
        producer.send(topics.anomalies, key=b"forged", value=b'{"schema": "attention-anomaly/1"}').get(timeout=30)
    producer.close(timeout=5)

    client = f"127.0.0.1:{scram_broker.port}"
    controller = f"127.0.0.1:{scram_broker.controller_port}"
    scram = ["security.protocol", "SASL_PLAINTEXT", "sasl.mechanism", "SCRAM-SHA-512", "sasl.jaas.config",
             'org.apache.kafka.common.security.scram.ScramLoginModule required username="{}" password="{}";']
    plain = ["security.protocol", "SASL_PLAINTEXT", "sasl.mechanism", "PLAIN", "sasl.jaas.config",
             'org.apache.kafka.common.security.plain.PlainLoginModule required username="intruder" '
             'password="intruder-password";']

    def as_user(options: list[str], user: str, password: str) -> list[str]:
        return [*options[:-1], options[-1].format(user, password)]

    attempts = {
        "client listener as intruder": grant_everything("bootstrap.servers", client,
                                                        *as_user(scram, "intruder", "intruder-password")),
        "controller, no credentials": grant_everything("bootstrap.controllers", controller),
        "controller as intruder (PLAIN)": grant_everything("bootstrap.controllers", controller, *plain),
        "controller as intruder (SCRAM)": grant_everything("bootstrap.controllers", controller,
                                                           *as_user(scram, "intruder", "intruder-password")),
    }
    assert all(result.startswith("REFUSED") for result in attempts.values()), attempts
    assert "ClusterAuthorization" in attempts["client listener as intruder"]
    # the tool itself works: the admin may grant
    assert grant_everything("bootstrap.servers", client, *as_user(scram, ADMIN_USER, ADMIN_PASSWORD)) == "GRANTED"
