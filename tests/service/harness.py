"""Running the real monitor (``python -m monitor run``) against the real broker."""

from __future__ import annotations

import base64
import contextlib
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from kafka import KafkaConsumer, KafkaProducer
from prometheus_client.parser import text_string_to_metric_families

from devstack.process import ManagedProcess, free_port
from devstack.wait import wait_for
from monitor.producer import TraceProducer
from monitor.protocol.model_contract import ContractTable
from monitor.protocol.topics import Topics
from tests.factories import CONTRACT, KEY_ID, SECRET

REPO = Path(__file__).resolve().parents[2]


def make_topics(make_topic, partitions: int = 2) -> Topics:
    return Topics(
        traces=make_topic("traces", partitions=partitions),
        outcomes=make_topic("outcomes", partitions=partitions),
        contracts=make_topic("contracts", partitions=1, configs={"cleanup.policy": "compact"}),
        anomalies=make_topic("anomalies", partitions=partitions),
        dead_letter=make_topic("dead-letter", partitions=1),
        references=make_topic("references", partitions=1, configs={"cleanup.policy": "compact"}),
        observations=make_topic("observations", partitions=partitions),
        judge_state=make_topic("judge-state", partitions=partitions, configs={"cleanup.policy": "compact"}),
        pending=make_topic("pending-outcomes", partitions=partitions),
    )


def publish_contracts(bootstrap: str, topics: Topics, contracts=(CONTRACT,)) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    for contract in contracts:
        key, value = ContractTable.record(contract, KEY_ID, SECRET)
        producer.send(topics.contracts, key=key, value=value)
    producer.flush()
    producer.close()


def monitor_env(bootstrap: str, topics: Topics, group: str, tmp: Path, **overrides: Any) -> dict[str, str]:
    keyring = tmp / "keyring.json"
    keyring.write_text(json.dumps({KEY_ID: SECRET.decode()}))
    env = {
        "PATH": "/usr/bin:/bin",
        "ATTENTION_MONITOR_BOOTSTRAP_SERVERS": bootstrap,
        "ATTENTION_MONITOR_GROUP_ID": group,
        "ATTENTION_MONITOR_TRACES_TOPIC": topics.traces,
        "ATTENTION_MONITOR_OUTCOMES_TOPIC": topics.outcomes,
        "ATTENTION_MONITOR_CONTRACTS_TOPIC": topics.contracts,
        "ATTENTION_MONITOR_ANOMALIES_TOPIC": topics.anomalies,
        "ATTENTION_MONITOR_DEAD_LETTER_TOPIC": topics.dead_letter,
        "ATTENTION_MONITOR_REFERENCES_TOPIC": topics.references,
        "ATTENTION_MONITOR_OBSERVATIONS_TOPIC": topics.observations,
        "ATTENTION_MONITOR_JUDGE_STATE_TOPIC": topics.judge_state,
        "ATTENTION_MONITOR_PENDING_TOPIC": topics.pending,
        "ATTENTION_MONITOR_KEYRING_FILE": str(keyring),
        "ATTENTION_MONITOR_ALLOWED_SCOPES": "demo:synthetic",
        "ATTENTION_MONITOR_METRICS_PORT": str(free_port()),
        "ATTENTION_MONITOR_REFERENCE_TRACES": "30",
        # Deterministic detection for tests: every collapsed trace (effect >= 11 sd) alarms
        # on its own, no healthy one (max 4.4 sd over 2000 traces) can.
        "ATTENTION_MONITOR_MIN_EFFECT": "6",
        "ATTENTION_MONITOR_FALSE_ALARM_ARL": "2",
        "ATTENTION_MONITOR_JOIN_TTL_S": "5",
        "ATTENTION_MONITOR_POLL_TIMEOUT_MS": "200",
        "ATTENTION_MONITOR_STATE_DIR": str(tmp / "state"),
        "ATTENTION_MONITOR_STATE_SAVE_INTERVAL_S": "0",
    }
    env.update({f"ATTENTION_MONITOR_{k.upper()}": str(v) for k, v in overrides.items()})
    return env


class Monitor:
    """``python -m monitor run`` as a child process with the given settings."""

    def __init__(self, env: dict[str, str], log: Path, name: str = "monitor"):
        self.env = env
        self.port = int(env["ATTENTION_MONITOR_METRICS_PORT"])
        self.process = ManagedProcess(name, [sys.executable, "-m", "monitor", "run"], log, cwd=REPO, env=env)

    def ready(self) -> bool:
        """Whether ``/readyz`` says 200 now."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def readiness(self) -> str:
        """What ``/readyz`` says now: its status and body."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as resp:
                return f"{resp.status} {resp.read().decode(errors='replace').strip()}"
        except urllib.error.HTTPError as exc:
            return f"{exc.code} {exc.read().decode(errors='replace').strip()}"
        except OSError as exc:
            return f"not answering: {exc}"

    def wait_ready(self, timeout: float = 60) -> None:
        def ready() -> bool:
            self.process.check_alive()
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as resp:
                return bool(resp.status == 200)

        wait_for(ready, timeout=timeout, what=f"monitor ready on :{self.port}")

    def metrics(self) -> dict[str, float]:
        """Sample name with sorted labels -> value, e.g. ``attention_monitor_traces_rejected_total{reason=x}``."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/metrics")
        user = self.env.get("ATTENTION_MONITOR_METRICS_BASIC_AUTH_USER")
        if user:  # the monitor's own basic auth, when the test set it
            password = self.env["ATTENTION_MONITOR_METRICS_BASIC_AUTH_PASSWORD"]
            request.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
        with urllib.request.urlopen(request, timeout=5) as resp:
            text = resp.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_until(self, probe, *, timeout: float, what: str):
        """:func:`wait_for`, and on failure the monitor's own log lines and nonzero
        rejection counters in the message (what a failing run on CI needs)."""
        with self.explaining():
            return wait_for(probe, timeout=timeout, what=what)

    @contextlib.contextmanager
    def explaining(self, lines: int = 25):
        """An assertion failing inside says what the monitor logged last (its own lines,
        not the Kafka clients') and its nonzero rejection counters."""
        try:
            yield
        except AssertionError as exc:
            logged = [line for line in self.process.log_path.read_text(errors="replace").splitlines()
                      if " kafka." not in line and "librdkafka" not in line][-lines:]
            rejected = {k: v for k, v in self.metrics().items() if "rejected" in k and v} if self.process.alive() \
                else "(monitor not running)"
            raise AssertionError(f"{exc}\nrejected: {rejected}\nmonitor log:\n" + "\n".join(logged)) from exc

    def value(self, name: str) -> float:
        try:
            return self.metrics().get(name, 0.0)
        except OSError:
            return 0.0


def series(name: str, **labels: Any) -> str:
    """The key :meth:`Monitor.metrics` uses for a sample."""
    inner = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}" if inner else name


def send_traces(bootstrap: str, topic: str, traces: Iterable[tuple[Any, Any]], partition: int | None = None) -> None:
    with TraceProducer(key_id=KEY_ID, secret=SECRET, topics=Topics(traces=topic),
                       bootstrap_servers=bootstrap) as producer:
        for header, weights in traces:
            producer.send(header, weights)


def send_requests(bootstrap: str, topics: Topics, scenario: Any, rng: np.random.Generator, requests: range,
                  outcome: Callable[[int], str], timestamp: Callable[[int], float] | None = None) -> None:
    """A scenario's requests as a model server sends them: each request's traces (one a
    layer, request id ``<revision>-<i>``) and then its outcome (``outcome(i)``)."""
    with TraceProducer(key_id=KEY_ID, secret=SECRET, topics=topics, bootstrap_servers=bootstrap) as producer:
        for i in requests:
            request_id = f"{scenario.revision}-{i}"
            at = time.time() if timestamp is None else timestamp(i)
            for header, weights in scenario.request(rng, request_id, timestamp=at):
                producer.send(header, weights)
            producer.send_outcome(request_id, outcome(i))
        producer.flush()


def send_raw(bootstrap: str, topic: str, records: Iterable[tuple[bytes, bytes]]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    for key, value in records:
        producer.send(topic, key=key, value=value)
    producer.flush()
    producer.close()


def send_outcomes(bootstrap: str, topic: str, outcomes: dict[str, str]) -> None:
    send_raw(bootstrap, topic, [(rid.encode(), json.dumps({"request_id": rid, "outcome": o}).encode())
                                for rid, o in outcomes.items()])


class OutputReader:
    """Reads every record of the output topics from the beginning, as they arrive."""

    def __init__(self, bootstrap: str, *topics: str):
        self.consumer = KafkaConsumer(*topics, bootstrap_servers=bootstrap, group_id=None,
                                      auto_offset_reset="earliest", enable_auto_commit=False,
                                      isolation_level="read_committed")
        self.records: dict[str, list[dict[str, Any]]] = {t: [] for t in topics}

    def poll(self) -> dict[str, list[dict[str, Any]]]:
        for tp, records in self.consumer.poll(timeout_ms=200).items():
            self.records[tp.topic] += [json.loads(r.value) for r in records]
        return self.records

    def wait(self, predicate, timeout: float, what: str) -> dict[str, list[dict[str, Any]]]:
        return wait_for(lambda: predicate(self.poll()) and self.records, timeout=timeout, what=what)

    def settle(self, quiet: float = 2.0) -> None:
        """Read until nothing new arrives for ``quiet`` seconds."""
        last, since = -1, time.monotonic()
        while time.monotonic() - since < quiet:
            self.poll()
            count = sum(len(v) for v in self.records.values())
            if count != last:
                last, since = count, time.monotonic()

    def close(self) -> None:
        self.consumer.close()


def measuring_processes(monitor: Monitor) -> list[int]:
    """The monitor's child processes, but for multiprocessing's resource tracker."""
    pid = monitor.process.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
