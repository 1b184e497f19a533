"""The monitor against the SASL/SCRAM broker with default-deny ACLs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import GroupAuthorizationFailedError, KafkaError, TopicAuthorizationFailedError

from devstack.kafka import ADMIN_PASSWORD, ADMIN_USER, classpath, create_scram_user, java
from devstack.wait import wait_for
from monitor.broker.acls import apply_acls
from tests.service.harness import Monitor, make_topics, monitor_env

pytestmark = pytest.mark.kafka
GRANT_ACL = Path(__file__).resolve().parents[1] / "data" / "GrantAcl.java"


def test_missing_acls_end_the_monitor_with_a_clear_reason_and_granted_acls_let_it_run(
        scram_broker, scram_admin, make_scram_topic, unique_name, tmp_path):
    topics = make_topics(make_scram_topic)
    user, password = unique_name("monitor"), "monitor-password"
    create_scram_user(scram_admin, user, password)
    group = unique_name("group")
    env = monitor_env(scram_broker.bootstrap, topics, group, tmp_path, security_protocol="SASL_PLAINTEXT",
                      sasl_username=user, sasl_password=password, startup_timeout_s=15)

    denied = Monitor(env, tmp_path / "denied.log", "denied")
    assert denied.process.proc.wait(60) == 3
    assert f"topic {topics.contracts} does not exist or this principal may not describe it" in \
        denied.process.log_path.read_text()

    assert apply_acls(scram_broker.client_config(), f"User:{user}", "monitor", topics, group) == 17
    allowed = Monitor(env, tmp_path / "allowed.log", "allowed")
    try:
        allowed.wait_ready(timeout=60)
        wait_for(lambda: allowed.value("attention_monitor_rebalances_total") >= 1, timeout=30,
                 what="partitions assigned under the granted ACLs")
    finally:
        allowed.process.stop()


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
