"""docker-compose.yml's secured Kafka, run for real without Docker: deploy/kafka/start.sh
(the compose entrypoint) on the Maven-resolved broker, then compose's init commands as
admin (topics, ACLs), then the monitor as User:monitor and a model server as
User:model-server with their password files, as compose runs them. The model server is
outside the compose network: it reaches the broker through the EXTERNAL listener the
compose file publishes, by the address KAFKA_EXTERNAL_ADVERTISED gives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from kafka import KafkaAdminClient
from kafka.errors import KafkaError

from devstack.kafka import classpath, java
from devstack.process import ManagedProcess, free_port
from devstack.wait import wait_for
from monitor.producer import TraceProducer
from monitor.tools.scenario import Scenario
from tests.factories import KEY_ID, SECRET
from tests.service.harness import Monitor, series

pytestmark = pytest.mark.kafka
REPO = Path(__file__).resolve().parents[2]
USERS = ("admin", "controller", "monitor", "model_server", "operator")


def fake_kafka_home(tmp: Path) -> Path:
    """bin/kafka-storage.sh and bin/kafka-server-start.sh as the image has them, on the
    jars devstack resolved."""
    home = tmp / "kafka-home"
    (home / "bin").mkdir(parents=True)
    for script, main in (("kafka-storage.sh", "kafka.tools.StorageTool"), ("kafka-server-start.sh", "kafka.Kafka")):
        path = home / "bin" / script
        path.write_text(f'#!/bin/sh\nexec {java()} -Xmx512m -cp "{classpath()}" '
                        f'-Dlog4j2.configurationFile={REPO / "devstack" / "log4j2.properties"} {main} "$@"\n')
        path.chmod(0o755)
    return home


def sasl_env(port: int, user: str, secrets: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "ATTENTION_MONITOR_BOOTSTRAP_SERVERS": f"127.0.0.1:{port}",
            "ATTENTION_MONITOR_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "ATTENTION_MONITOR_SASL_USERNAME": user,
            "ATTENTION_MONITOR_SASL_PASSWORD_FILE": str(secrets / f"kafka_{user.replace('-', '_')}_password")}


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "monitor", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_the_compose_broker_starts_secured_and_its_principals_do_their_jobs(tmp_path):
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for user in USERS:
        (secrets / f"kafka_{user}_password").write_text(f"{user}-password-{tmp_path.name}\n")
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["kafka"]
    assert any(str(p).endswith(":9094") for p in compose["ports"])  # EXTERNAL's container port, published
    assert "KAFKA_EXTERNAL_ADVERTISED" in compose["environment"]
    port, controller, external = free_port(), free_port(), free_port()
    broker = ManagedProcess("compose-kafka", ["bash", str(REPO / "deploy" / "kafka" / "start.sh")],
                            tmp_path / "kafka.log", env={
                                "SECRETS_DIR": str(secrets), "KAFKA_DATA_DIR": str(tmp_path / "data"),
                                "KAFKA_HOST": "127.0.0.1", "KAFKA_HOME": str(fake_kafka_home(tmp_path)),
                                "KAFKA_PROPERTIES": str(tmp_path / "server.properties"),
                                "KAFKA_ADMIN_PROPERTIES": str(tmp_path / "admin.properties"),
                                "KAFKA_CLIENT_PORT": str(port), "KAFKA_CONTROLLER_PORT": str(controller),
                                "KAFKA_EXTERNAL_PORT": str(external),
                                # the name hosts outside the compose network reach the published port by
                                "KAFKA_EXTERNAL_ADVERTISED": f"localhost:{external}"})
    monitor = None
    try:
        admin_config = {"bootstrap_servers": f"127.0.0.1:{port}", "security_protocol": "SASL_PLAINTEXT",
                        "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "admin",
                        "sasl_plain_password": f"admin-password-{tmp_path.name}"}

        def lists_topics() -> bool:
            broker.check_alive()
            client = KafkaAdminClient(**admin_config, request_timeout_ms=3000)
            client.list_topics()
            client.close()
            return True

        wait_for(lists_topics, timeout=90, what="the compose broker answering the admin")
        init = sasl_env(port, "admin", secrets)
        for args in (("topics", "create", "--partitions", "2", "--replication-factor", "1"),
                     ("acls", "apply", "--principal", "User:monitor", "--role", "monitor"),
                     ("acls", "apply", "--principal", "User:model-server", "--role", "model-server"),
                     ("acls", "apply", "--principal", "User:operator", "--role", "operator")):
            done = cli(init, *args)
            assert done.returncode == 0, (args, done.stdout, done.stderr)

        keyring = tmp_path / "keyring.json"
        keyring.write_text(json.dumps({KEY_ID: {"secret": SECRET.decode(), "tenants": ["demo"], "contracts": True}}))
        env = sasl_env(port, "monitor", secrets) | {
            "ATTENTION_MONITOR_KEYRING_FILE": str(keyring), "ATTENTION_MONITOR_ALLOWED_SCOPES": "demo:synthetic",
            "ATTENTION_MONITOR_METRICS_PORT": str(free_port()), "ATTENTION_MONITOR_STATE_DIR": str(tmp_path / "state")}
        monitor = Monitor(env, tmp_path / "monitor.log")
        monitor.wait_ready(timeout=90)

        scenario = Scenario(revision="rev-1")
        producer_config = {"bootstrap_servers": f"localhost:{external}", "security_protocol": "SASL_PLAINTEXT",
                           "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "model-server",
                           "sasl_plain_password": f"model_server-password-{tmp_path.name}"}
        rng = np.random.default_rng(0)
        with TraceProducer(key_id=KEY_ID, secret=SECRET, **producer_config) as producer:
            producer.publish_contract(scenario.contract()).get(timeout=30)
            for i in range(5):
                for header, weights in scenario.request(rng, f"compose-{i}"):
                    producer.send(header, weights)
                producer.send_outcome(f"compose-{i}", "success")
        traced = series("attention_traces_total", layer="0", model="scenario-lm", revision="rev-1")
        monitor.wait_until(lambda: monitor.value(traced) == 5, timeout=60, what="the model server's traces measured")
        with pytest.raises(KafkaError):  # the external listener authenticates: a wrong password gets nothing
            KafkaAdminClient(**{**producer_config, "sasl_plain_password": "not-the-password"},
                             request_timeout_ms=3000)
        # the operator may read the outputs and write reference decisions, and nothing more
        operator = sasl_env(port, "operator", secrets)
        assert cli(operator, "reference", "pin", "scenario-lm@rev-2", "--to", "rev-1").returncode == 0
        denied = cli(operator, "topics", "create")
        assert denied.returncode == 3 and "Authorization" in denied.stderr
    finally:
        if monitor is not None:
            monitor.process.stop()
        broker.stop()
