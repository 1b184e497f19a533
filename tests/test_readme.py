"""The README's first run, as written, against the real broker: topics created by
``attention-monitor topics create``, a keyring made by ``keyring new``, ``check-config``,
``attention-monitor run``, and the README's own producer snippet (taken from the README,
not a copy) publishing a contract, a trace and an outcome that the monitor measures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from kafka import KafkaAdminClient

from devstack.process import free_port
from monitor.protocol.topics import DEFAULT, layout
from tests.service.harness import Monitor, series

pytestmark = pytest.mark.kafka
REPO = Path(__file__).resolve().parent.parent


def readme_snippet() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Publishing traces from a model server", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, "the README's producer section has no python block"
    return found[1]


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "monitor", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_the_readme_first_run_works_as_written(kafka_broker, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "ATTENTION_MONITOR_BOOTSTRAP_SERVERS": kafka_broker.bootstrap}
    admin = KafkaAdminClient(**kafka_broker.client_config())
    try:
        created = cli(env, "topics", "create", "--partitions", "2", "--replication-factor", "1")
        assert created.returncode == 0, created.stderr
        assert f"{DEFAULT.traces}: created (2 partitions max.message.bytes=" in created.stdout
        again = cli(env, "topics", "create", "--partitions", "2", "--replication-factor", "1")
        assert again.returncode == 0 and f"{DEFAULT.contracts}: exists" in again.stdout, again.stderr
        assert {spec.name for spec in layout()} <= set(admin.list_topics())

        keyring = tmp_path / "keyring.json"
        made = cli(env, "keyring", "new", str(keyring), "--key-id", "team-a")
        assert made.returncode == 0, made.stderr
        assert keyring.stat().st_mode & 0o777 == 0o600
        assert cli(env, "keyring", "new", str(keyring), "--key-id", "team-b").returncode == 2  # never overwritten
        env |= {"ATTENTION_MONITOR_KEYRING_FILE": str(keyring), "ATTENTION_MONITOR_ALLOWED_SCOPES": "team-a:internal",
                "ATTENTION_MONITOR_METRICS_PORT": str(free_port())}
        checked = cli(env, "check-config")
        assert checked.returncode == 0 and "configuration ok" in checked.stdout, checked.stdout + checked.stderr

        monitor = Monitor(env, tmp_path / "monitor.log")
        try:
            monitor.wait_ready()
            (tmp_path / "first_trace.py").write_text(readme_snippet())
            published = subprocess.run([sys.executable, str(tmp_path / "first_trace.py")], cwd=REPO, env=env,
                                       capture_output=True, text=True, timeout=60, check=False)
            assert published.returncode == 0, published.stderr
            traced = series("attention_traces_total", layer="0", model="my-model", revision="weights-sha256-abc")
            monitor.wait_until(lambda: monitor.value(traced) == 1, timeout=60, what="the README's trace measured")
            joined = series("attention_trace_outcomes_total", layer="0", model="my-model", outcome="success",
                            revision="weights-sha256-abc")
            monitor.wait_until(lambda: monitor.value(joined) == 1, timeout=60, what="the README's outcome joined")
            rejected = {k: v for k, v in monitor.metrics().items() if "traces_rejected_total" in k and v}
            assert not rejected
        finally:
            monitor.process.stop()
    finally:
        admin.delete_topics([spec.name for spec in layout()], raise_errors=False)
        admin.close()
