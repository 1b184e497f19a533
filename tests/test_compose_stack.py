"""docker-compose.yml's services run on their real parts, with the very files and
commands the compose file gives them (no Docker engine runs here):

- Kafka is ``deploy/kafka/start.sh`` itself (its rendered config, its SCRAM users from
  ``deploy/secrets``), the broker from Maven Central: ``kafka-init``'s commands create the
  topics and ACLs, and a model server outside the compose network publishes through the
  EXTERNAL listener the compose file publishes;
- Prometheus and Alertmanager are the Debian binaries with the compose file's flags and
  ``deploy/web-config.yml``: every page and API wants the password, the lifecycle API is
  off;
- the monitor image's entry point hands a 0600 keyring, as ``keyring new`` writes it, to
  the unprivileged user that runs the command.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from kafka import KafkaAdminClient, KafkaConsumer
from kafka.errors import KafkaError

from devstack.kafka import LOG4J2, MECHANISM, classpath, java
from devstack.process import ManagedProcess, free_port
from devstack.prometheus import binary, prometheus_config
from devstack.wait import wait_for

REPO = Path(__file__).resolve().parent.parent
SECRETS = REPO / "deploy" / "secrets"
BIN = Path(sys.executable).parent


def _compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _secret(name: str) -> str:
    return (SECRETS / name).read_text().strip()


def _fake_kafka_home(home: Path) -> Path:
    """A KAFKA_HOME whose two scripts start.sh calls run the broker resolved from Maven."""
    (home / "bin").mkdir(parents=True)
    base = f'exec {java()} -Xmx512m -cp "{classpath()}" -Dlog4j2.configurationFile={LOG4J2}'
    for name, main in (("kafka-storage.sh", "kafka.tools.StorageTool"), ("kafka-server-start.sh", "kafka.Kafka")):
        script = home / "bin" / name
        script.write_text(f'#!/bin/sh\n{base} {main} "$@"\n')
        script.chmod(0o755)
    return home


def _sasl(bootstrap: str, user: str, password: str) -> dict[str, str]:
    return {"bootstrap_servers": bootstrap, "security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": MECHANISM,
            "sasl_plain_username": user, "sasl_plain_password": password}


def _service_env(service: dict, bootstrap: str) -> dict[str, str]:
    """A compose service's environment, its secrets the files compose mounts them from,
    its bootstrap replaced."""
    files = {name: REPO / secret["file"] for name, secret in _compose()["secrets"].items()}
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    for name, value in service["environment"].items():
        secret = str(value).removeprefix("/run/secrets/")
        env[name] = str(files[secret]) if secret != str(value) else str(value)
    env["ATTENTION_MONITOR_BOOTSTRAP_SERVERS"] = bootstrap
    return env


@pytest.mark.kafka
def test_a_model_server_outside_the_compose_network_publishes_through_the_external_listener(tmp_path):
    services = _compose()["services"]
    kafka = services["kafka"]
    assert any(str(p).endswith(":9094") for p in kafka["ports"]), kafka.get("ports")  # EXTERNAL's container port
    assert "KAFKA_EXTERNAL_ADVERTISED" in kafka["environment"]
    client, controller, external = free_port(), free_port(), free_port()
    env = {"SECRETS_DIR": str(SECRETS), "KAFKA_DATA_DIR": str(tmp_path / "data"), "KAFKA_HOST": "127.0.0.1",
           "KAFKA_HOME": str(_fake_kafka_home(tmp_path / "kafka-home")), "KAFKA_CLIENT_PORT": str(client),
           "KAFKA_CONTROLLER_PORT": str(controller), "KAFKA_EXTERNAL_PORT": str(external),
           # what KAFKA_EXTERNAL_ADVERTISED says in compose: the name outside hosts reach it by
           "KAFKA_EXTERNAL_ADVERTISED": f"localhost:{external}",
           "KAFKA_PROPERTIES": str(tmp_path / "server.properties"),
           "KAFKA_ADMIN_PROPERTIES": str(tmp_path / "admin.properties")}
    broker = ManagedProcess("compose-kafka", ["/bin/bash", str(REPO / "deploy" / "kafka" / "start.sh")],
                            tmp_path / "kafka.log", env=env)
    inside = f"127.0.0.1:{client}"
    try:
        def answers() -> bool:
            broker.check_alive()
            admin = KafkaAdminClient(**_sasl(inside, "admin", _secret("kafka_admin_password")),
                                     request_timeout_ms=3000)
            admin.close()
            return True

        wait_for(answers, timeout=120, what="the compose broker answering on its CLIENT listener")
        init = services["kafka-init"]
        result = subprocess.run(["/bin/sh", "-c", init["command"][0]], env=_service_env(init, inside),
                                capture_output=True, text=True, timeout=180, check=False)
        assert result.returncode == 0, result.stdout + result.stderr

        # the model server: demo-producer's principal and keyring, but from outside the network
        outside = f"localhost:{external}"
        producer_env = _service_env(services["demo-producer"], outside)
        result = subprocess.run([str(BIN / "attention-monitor"), "produce", "--synthetic", "--requests", "3",
                                 "--rate", "100"], env=producer_env, capture_output=True, text=True, timeout=120,
                                check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        sent = int(re.search(r"and (\d+) traces", result.stdout)[1])
        consumer = KafkaConsumer("attention-traces", **_sasl(outside, "admin", _secret("kafka_admin_password")),
                                 auto_offset_reset="earliest", consumer_timeout_ms=15000)
        try:
            assert sum(1 for _ in consumer) == sent > 0
        finally:
            consumer.close()
        with pytest.raises(KafkaError):  # the listener authenticates: a wrong password gets nothing
            KafkaAdminClient(**_sasl(outside, "model-server", "not-the-password"), request_timeout_ms=3000)
    finally:
        broker.stop()


def _get(url: str, password: str | None, method: str = "GET") -> int:
    request = urllib.request.Request(url, method=method)
    if password is not None:
        token = base64.b64encode(f"attention:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _flags(service: dict, paths: dict[str, Path], port: int) -> list[str]:
    """The compose command's flags, container paths replaced by local ones."""
    flags = []
    for flag in service["command"]:
        name, _, value = flag.partition("=")
        flags.append(f"{name}={paths.get(name, Path(value))}" if value else flag)
    return [*flags, f"--web.listen-address=127.0.0.1:{port}"]


@pytest.mark.prometheus
def test_prometheus_and_alertmanager_want_the_password_and_have_no_lifecycle_api(tmp_path):
    services = _compose()["services"]
    password = _secret("web_password")
    config = prometheus_config({"prometheus": ["127.0.0.1:1"]}, ["127.0.0.1:1"])
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prom_port, am_port = free_port(), free_port()
    web = REPO / "deploy" / "web-config.yml"
    prometheus = ManagedProcess("compose-prometheus", [binary("prometheus"), *_flags(services["prometheus"], {
        "--config.file": tmp_path / "prometheus.yml", "--storage.tsdb.path": tmp_path / "tsdb",
        "--web.config.file": web}, prom_port)], tmp_path / "prometheus.log")
    (tmp_path / "alertmanager.yml").write_text((REPO / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
    alertmanager = ManagedProcess("compose-alertmanager", [
        binary("prometheus-alertmanager", "alertmanager"), *_flags(services["alertmanager"], {
            "--config.file": tmp_path / "alertmanager.yml", "--storage.path": tmp_path / "am",
            "--web.config.file": web}, am_port), "--cluster.listen-address="], tmp_path / "alertmanager.log")
    try:
        for url, process in ((f"http://127.0.0.1:{prom_port}", prometheus),
                             (f"http://127.0.0.1:{am_port}", alertmanager)):
            wait_for(lambda url=url, process=process: process.check_alive() is None
                     and _get(f"{url}/-/ready", password) == 200, timeout=30, what=f"{process.name} ready")
            assert _get(f"{url}/-/ready", None) == 401
            assert _get(f"{url}/-/ready", "not-the-password") == 401
        api = f"http://127.0.0.1:{prom_port}/api/v1/status/config"
        assert (_get(api, None), _get(api, password)) == (401, 200)
        silences = f"http://127.0.0.1:{am_port}/api/v2/silences"
        assert (_get(silences, None), _get(silences, password)) == (401, 200)
        # the lifecycle API is off: nobody reloads or stops Prometheus over HTTP
        assert _get(f"http://127.0.0.1:{prom_port}/-/reload", password, "POST") == 403
        assert _get(f"http://127.0.0.1:{prom_port}/-/quit", password, "POST") == 403
    finally:
        prometheus.stop()
        alertmanager.stop()
    # Prometheus reaches Alertmanager and itself with that password, Grafana reaches Prometheus with it
    deployed = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    auths = [deployed["alerting"]["alertmanagers"][0]["basic_auth"],
             next(j for j in deployed["scrape_configs"] if j["job_name"] == "prometheus")["basic_auth"]]
    assert all(a == {"username": "attention", "password_file": "/run/secrets/web_password"} for a in auths)
    assert "web_password" in services["prometheus"]["secrets"] and "web_password" in services["grafana"]["secrets"]
    source = (REPO / "dashboards" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    datasource = yaml.safe_load(source)["datasources"][0]
    assert datasource["basicAuthUser"] == "attention"
    assert datasource["secureJsonData"]["basicAuthPassword"] == "$__file{/run/secrets/web_password}"


@pytest.mark.skipif(os.geteuid() != 0, reason="the entry point changes user only when started as root, as in the image")
def test_the_image_entry_point_hands_a_0600_keyring_to_the_user_that_runs_the_command(tmp_path):
    """As compose mounts it: the host file's owner (root here) and mode (0600, as
    ``keyring new`` writes it) kept. Read directly, the unprivileged user is refused;
    through the entry point, the command runs as that user and reads its own copy."""
    secrets = Path(tempfile.mkdtemp(prefix="secrets-"))
    private = Path(tempfile.mkdtemp(prefix="private-")) / "copies"
    try:
        keyring = secrets / "attention_keyring"
        result = subprocess.run([str(BIN / "attention-monitor"), "keyring", "new", str(keyring), "--key-id", "team-a"],
                                capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stderr
        assert stat.S_IMODE(keyring.stat().st_mode) == 0o600
        for folder in (secrets, private.parent):
            folder.chmod(0o755)
        env = {"PATH": "/usr/bin:/bin", "ATTENTION_MONITOR_KEYRING_FILE": str(keyring),
               "ATTENTION_MONITOR_SECRETS_DIR": str(secrets), "ATTENTION_MONITOR_PRIVATE_DIR": str(private),
               "ATTENTION_MONITOR_RUN_AS": "65534:65534", "ATTENTION_MONITOR_METRICS_PORT": "9464"}
        show = 'id -u; echo "$ATTENTION_MONITOR_KEYRING_FILE"; cat "$ATTENTION_MONITOR_KEYRING_FILE"'
        denied = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "/bin/sh",
                                 "-c", show], env=env, capture_output=True, text=True, check=False)
        assert denied.returncode != 0 and "Permission denied" in denied.stderr  # the problem, as compose has it
        ran = subprocess.run([str(REPO / "deploy" / "monitor" / "entrypoint.sh"), "/bin/sh", "-c", show], env=env,
                             capture_output=True, text=True, check=False)
        assert ran.returncode == 0, ran.stderr
        uid, path, *content = ran.stdout.splitlines()
        assert uid == "65534" and Path(path).parent == private
        assert "team-a" in "\n".join(content) and "\n".join(content).strip() == keyring.read_text().strip()
        assert stat.S_IMODE(Path(path).stat().st_mode) == 0o400 and Path(path).stat().st_uid == 65534
        assert "/usr/local/bin/attention-monitor-entrypoint" in (REPO / "Dockerfile").read_text()
        assert _compose()["services"]["kafka-init"]["entrypoint"][0] == "/usr/local/bin/attention-monitor-entrypoint"
    finally:
        shutil.rmtree(secrets, ignore_errors=True)
        shutil.rmtree(private.parent, ignore_errors=True)
