"""docker-compose.yml is valid Compose and declares the production stack."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import jsonschema
import yaml

REPO = Path(__file__).resolve().parent.parent
VENDORED_SCHEMA = REPO / "tests" / "data" / "compose-spec.json"


def _compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _errors(doc: dict) -> list[str]:
    schema = json.loads(VENDORED_SCHEMA.read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=str)
    return [f"{list(e.absolute_path)}: {e.message}" for e in errors]


def test_compose_validates_against_the_compose_specification():
    errors = _errors(_compose())
    assert not errors, "\n".join(errors)


def test_the_validation_refuses_what_compose_would_refuse():
    broken = _compose()
    broken["services"]["monitor"]["restart"] = ["unless-stopped"]  # a string, not a list
    broken["services"]["kafka"]["healthcheck"]["interval"] = 10  # a duration string
    broken["servicez"] = {}
    errors = _errors(broken)
    assert any("servicez" in e for e in errors), errors
    assert any("'monitor', 'restart'" in e for e in errors), errors
    assert any("'interval'" in e for e in errors), errors


def test_the_vendored_schema_is_the_recorded_copy():
    """tests/data/README.md records the SHA-256 of the schema as taken from the Compose
    Specification; an edit to the copy shows here."""
    recorded = re.search(r"sha256\s+([0-9a-f]{64})", (VENDORED_SCHEMA.parent / "README.md").read_text())
    assert recorded, "tests/data/README.md records no sha256 of compose-spec.json"
    assert hashlib.sha256(VENDORED_SCHEMA.read_bytes()).hexdigest() == recorded[1]
    assert json.loads(VENDORED_SCHEMA.read_text())["title"] == "Compose Specification"


def test_compose_declares_the_stack():
    services = _compose()["services"]
    assert {"kafka", "prometheus", "alertmanager", "grafana", "monitor"} <= services.keys()
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:4.")
    rendered = (REPO / "deploy" / "kafka" / "start.sh").read_text()
    assert "process.roles=broker,controller" in rendered  # KRaft, no ZooKeeper
    assert "zookeeper" not in services


def test_compose_mounts_the_files_the_tests_use():
    services = _compose()["services"]
    mounts = {v.split(":")[0] for s in services.values() for v in s.get("volumes", []) if v.startswith("./")}
    for path in mounts | {s["file"] for s in _compose()["secrets"].values()}:
        assert (REPO / path).exists(), f"docker-compose.yml mounts {path}, which is not in the repository"


def test_compose_creates_topics_and_acls_with_the_monitors_own_commands():
    services = _compose()["services"]
    init = services["kafka-init"]
    assert init["image"] == services["monitor"]["image"]
    script = " ".join(init["command"])
    assert script.startswith("attention-monitor topics create")
    for principal, role in (("monitor", "monitor"), ("model-server", "model-server"), ("operator", "operator")):
        assert f"acls apply --principal User:{principal} --role {role}" in script
    assert services["monitor"]["depends_on"]["kafka-init"]["condition"] == "service_completed_successfully"


def test_every_kafka_client_in_compose_authenticates_as_its_own_principal():
    services = _compose()["services"]
    users = {name: s["environment"].get("ATTENTION_MONITOR_SASL_USERNAME") for name, s in services.items()
             if "ATTENTION_MONITOR_BOOTSTRAP_SERVERS" in s.get("environment", {})}
    assert users == {"kafka-init": "admin", "monitor": "monitor", "demo-producer": "model-server"}
    for name in users:
        env = services[name]["environment"]
        assert env["ATTENTION_MONITOR_SECURITY_PROTOCOL"] == "SASL_PLAINTEXT"
        secret = env["ATTENTION_MONITOR_SASL_PASSWORD_FILE"].removeprefix("/run/secrets/")
        assert secret in services[name]["secrets"]
    secure = [line for line in (REPO / "deploy" / "kafka" / "secure.properties").read_text().splitlines()
              if not line.startswith("#")]
    assert "allow.everyone.if.no.acl.found=false" in secure and "super.users=User:admin;User:controller" in secure
