"""The whole stack on real parts: broker → monitor → Prometheus (the repository's rules,
time-scaled) → Alertmanager (the repository's config) → a webhook.

Prometheus runs the rule files with every ``for:`` and range window divided by 60 (10
minutes become 10 seconds); expressions, labels and annotations are the deployed ones,
and promtool checks the real timings (test_rules_and_dashboards.py).
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from devstack.prometheus import start_alertmanager, start_prometheus
from devstack.wait import wait_for
from devstack.webhook import WebhookReceiver
from monitor.producer import TraceProducer
from tests.factories import KEY_ID, SECRET, make_trace
from tests.service.harness import Monitor, make_topics, monitor_env, publish_contracts

pytestmark = [pytest.mark.kafka, pytest.mark.prometheus]
REPO = Path(__file__).resolve().parents[2]
SPEEDUP = 60
PROMQL_WORDS = {
    "sum", "rate", "irate", "increase", "by", "without", "ignoring", "on", "group_left", "group_right", "and", "or",
    "unless", "max", "min", "avg", "count", "time", "absent", "scalar", "histogram_quantile", "le", "bool", "offset",
}


class Traffic(threading.Thread):
    """Healthy traces of layers 0 and 1 with outcomes, ~15 requests/s; ``collapse`` makes
    layer 1's heads attend alike."""

    def __init__(self, bootstrap: str, topics):
        super().__init__(daemon=True)
        self.bootstrap, self.topics = bootstrap, topics
        self.collapse = threading.Event()
        self.stopped = threading.Event()
        self.sent = 0

    def run(self) -> None:
        with TraceProducer(key_id=KEY_ID, secret=SECRET, topics=self.topics,
                           bootstrap_servers=self.bootstrap) as traces:
            seed = 0
            while not self.stopped.is_set():
                seed += 1
                request = None
                for layer in (0, 1):
                    drift = 0.95 if layer == 1 and self.collapse.is_set() else 0.0
                    header, weights = make_trace(seed * 2 + layer, layer=layer, keys=64, rows=6, collapse=drift,
                                                 request_id=request)
                    request = header.request_id
                    traces.send(header, weights)
                    self.sent += 1
                traces.send_outcome(request, "failure" if self.collapse.is_set() else "success")
                traces.flush()
                time.sleep(1 / 15)


@pytest.fixture(scope="module")
def stack(kafka_broker, tmp_path_factory):
    from kafka import KafkaAdminClient

    from tests.conftest import _topic_factory

    tmp = tmp_path_factory.mktemp("stack")
    admin = KafkaAdminClient(**kafka_broker.client_config())
    factory = _topic_factory(admin, lambda kind: f"{kind}-stack-{time.time_ns()}")
    topics = make_topics(next(factory))
    publish_contracts(kafka_broker.bootstrap, topics)
    env = monitor_env(kafka_broker.bootstrap, topics, f"stack-{time.time_ns()}", tmp, detail_level="head",
                      join_ttl_s=2)
    monitor = Monitor(env, tmp / "monitor.log")
    webhook = WebhookReceiver()
    am = start_alertmanager(webhook.url, tmp / "alertmanager")
    prom = start_prometheus({"attention-monitor": [f"127.0.0.1:{monitor.port}"]}, [am.address], tmp / "prometheus",
                            rules=False)
    traffic = Traffic(kafka_broker.bootstrap, topics)
    try:
        monitor.wait_ready()
        wait_for(lambda: prom.query('up{job="attention-monitor"} == 1'), timeout=30, what="the first scrape")
        prom.load_rules(SPEEDUP)
        traffic.start()
        yield monitor, prom, am, webhook, traffic
    finally:
        traffic.stopped.set()
        traffic.join(10)
        prom.stop()
        am.stop()
        webhook.close()
        monitor.process.stop()
        next(factory, None)
        admin.close()


def exposed_names(monitor: Monitor) -> set[str]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{monitor.port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples} | {"up"}


def metric_names(expr: str) -> set[str]:
    """Metric and recording-rule names a PromQL expression reads."""
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\b(by|without|ignoring|on|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*\b(?!\s*\()", expr))
    return {n for n in names if n not in PROMQL_WORDS and not n.startswith("$") and not n.startswith("__")}


def rules_and_dashboard_exprs() -> tuple[set[str], list[tuple[str, str]]]:
    doc = yaml.safe_load((REPO / "alerts" / "attention.rules.yml").read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    records = {r["record"] for r in rules if "record" in r}
    exprs = [(r.get("alert") or r["record"], r["expr"]) for r in rules]
    for path in (REPO / "dashboards").glob("*.json"):
        for panel in json.loads(path.read_text())["panels"]:
            exprs += [(f"{path.name}: {panel['title']}", t["expr"]) for t in panel["targets"]]
    return records, exprs


def test_every_metric_in_rules_and_dashboards_is_really_exposed(stack):
    monitor = stack[0]
    wait_for(lambda: monitor.value("attention_monitor_traces_consumed_total") > 20, timeout=60,
             what="traces consumed")
    exposed = exposed_names(monitor)
    records, exprs = rules_and_dashboard_exprs()
    missing = {(where, name) for where, expr in exprs for name in metric_names(expr)
               if name not in exposed and name not in records}
    assert not missing, sorted(missing)
    assert metric_names('sum by (kind) (rate(attention_anomalies_total{model=~"$m"}[5m]))') == \
        {"attention_anomalies_total"}  # the extraction itself


def firing(prom) -> set[str]:
    return {a["labels"]["alertname"] for a in prom.alerts() if a["state"] in ("pending", "firing")}


def quiet_period() -> float:
    """How long healthy traffic must raise nothing, from the deployed rules at test
    speed: the longest ``for:`` of an anomaly alert plus the longest rate window the
    anomaly rules read (a window fully inside healthy traffic, held for that long)."""
    doc = yaml.safe_load((REPO / "alerts" / "attention.rules.yml").read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    anomaly = [r for r in rules if "anomal" in r["expr"] or "diversity" in r["expr"]]
    seconds = {"s": 1, "m": 60, "h": 3600}
    longest_for = max(int(r["for"][:-1]) * seconds[r["for"][-1]] for r in anomaly if "alert" in r)
    windows = [int(n) * seconds[u] for r in anomaly for n, u in re.findall(r"rate\([^\[]*\[(\d+)([smh])\]", r["expr"])]
    return (longest_for + max(windows)) / SPEEDUP


def test_healthy_traffic_fires_nothing_then_a_collapsing_layer_fires_low_diversity_and_fills_the_dashboards(stack):
    """One story, in order: healthy traffic (nothing pending or firing for a full quiet
    period), then layer 1 collapses (the low-diversity alert reaches the webhook for
    layer 1 only), then every dashboard panel query returns data."""
    monitor, prom, _am, webhook, traffic = stack
    assert not traffic.collapse.is_set()
    wait_for(lambda: monitor.value("attention_monitor_traces_consumed_total") >= 120, timeout=90,
             what="references learnt (30 traces per layer) and healthy traffic flowing")
    healthy_until = time.monotonic() + quiet_period()
    while time.monotonic() < healthy_until:
        assert not firing(prom), prom.alerts()
        time.sleep(1)
    assert not webhook.alert_names(), webhook.received

    traffic.collapse.set()
    started = time.monotonic()
    wait_for(lambda: "AttentionLowHeadDiversity" in webhook.alert_names(), timeout=90,
             what="AttentionLowHeadDiversity delivered by Alertmanager to the webhook")
    took = time.monotonic() - started
    alert = next(a for body in webhook.received for a in body["alerts"]
                 if a["labels"]["alertname"] == "AttentionLowHeadDiversity")
    assert alert["labels"]["layer"] == "1" and alert["labels"]["model"] == "test-model"
    assert alert["labels"]["severity"] == "warning"
    assert "not an automatic pruning command" in alert["annotations"]["policy"]
    assert alert["annotations"]["runbook_url"].endswith("AttentionLowHeadDiversity.md")
    assert not any(a["labels"].get("layer") == "0" for body in webhook.received for a in body["alerts"]
                   if a["labels"]["alertname"] in {"AttentionLowHeadDiversity", "AttentionEntropyCollapse"})
    print(f"low-diversity alert delivered {took:.0f} s after the collapse began")

    wait_for(lambda: prom.query('model_revision_layer_kind:attention_anomaly_failure_ratio:1h'), timeout=60,
             what="anomalies joined to outcomes recorded")
    empty = []
    for path in sorted((REPO / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                expr = (target["expr"].replace("$__rate_interval", "10s").replace("$model", "test-model")
                        .replace("$revision", "rev-1").replace("$layer", ".*"))
                if not prom.query(expr):
                    empty.append(f"{path.name}: {panel['title']}: {target['expr']}")
    assert not empty, "\n".join(empty)
