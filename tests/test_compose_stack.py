"""docker-compose.yml's services run on their real parts, with the very files and
commands the compose file gives them (no Docker engine runs here; Kafka, with a model
server outside the compose network, is tests/devstack/test_compose_kafka.py):

- Prometheus and Alertmanager are the Debian binaries with the compose file's flags and
  ``deploy/web-config.yml``: every page and API wants the password, the lifecycle API is
  off;
- the monitor image's entry point hands a 0600 keyring, as ``keyring new`` writes it, to
  the unprivileged user that runs the command.
"""

from __future__ import annotations

import base64
import os
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
