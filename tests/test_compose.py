"""docker-compose.yml is valid Compose and declares the production stack."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import yaml

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO.parent / "shared" / "schemas" / "compose-spec.json"
VENDORED_SCHEMA = REPO / "tests" / "data" / "compose-spec.json"


def _compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_validates_against_the_compose_specification():
    schema = json.loads(VENDORED_SCHEMA.read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(_compose()), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_vendored_schema_matches_the_shared_one_when_present():
    if SCHEMA.exists():
        assert json.loads(SCHEMA.read_text()) == json.loads(VENDORED_SCHEMA.read_text())


def test_compose_declares_the_stack():
    services = _compose()["services"]
    assert {"kafka", "prometheus", "alertmanager", "grafana", "monitor"} <= services.keys()
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:4.")
    assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft, no ZooKeeper
    assert "zookeeper" not in services


def test_compose_mounts_the_files_the_tests_use():
    services = _compose()["services"]
    mounts = {v.split(":")[0] for s in services.values() for v in s.get("volumes", []) if v.startswith("./")}
    for path in mounts | {s["file"] for s in _compose()["secrets"].values()}:
        assert (REPO / path).exists(), f"docker-compose.yml mounts {path}, which is not in the repository"
