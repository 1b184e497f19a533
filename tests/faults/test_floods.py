"""Floods of invented layers and model revisions stay bounded: the first release grew to
174,021 series (a 16.7 MB /metrics page) on 2,000 contracts with distinct layer numbers,
and to 259 + 222 MB and a 13 MB state file on 5,000 invented revisions."""

from __future__ import annotations

import json

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from monitor.protocol.model_contract import LayerContract, ModelContract
from monitor.tools.synthetic import make_header
from tests.faults.accounting import processed
from tests.service.harness import Monitor, make_topics, monitor_env, publish_contracts, send_traces

pytestmark = [pytest.mark.kafka, pytest.mark.faults]
LAYERS, REVISIONS = 300, 150
CAPS = {"max_layer_series": 20, "max_references": 10, "max_model_revisions": 5}


def uniform(header) -> np.ndarray:
    h, r, k = header.shape
    weights = np.zeros((h, r, k), np.float16)
    for row, p in enumerate(header.query_positions):
        weights[:, row, : p + 1] = 1.0 / (p + 1)
    return weights


def contract(revision: str, layers: range) -> ModelContract:
    return ModelContract(model_id="flood", model_revision=revision, mask="causal", scale=0.25, layers=tuple(
        LayerContract(layer=n, d_model=32, head_dim=16, value_dim=16, heads=("head-0", "head-1"), kv_groups=(0, 1))
        for n in layers))


def series_count(monitor: Monitor) -> int:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{monitor.port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(len(f.samples) for f in text_string_to_metric_families(text))


def test_layer_and_revision_floods_stay_within_their_caps(kafka_broker, make_topic, unique_name, tmp_path):
    bootstrap = kafka_broker.bootstrap
    topics = make_topics(make_topic)
    wide = contract("wide", range(LAYERS))
    invented = [contract(f"invented-{i}", range(1)) for i in range(REVISIONS)]
    publish_contracts(bootstrap, topics, [wide, *invented])
    env = monitor_env(bootstrap, topics, unique_name("group"), tmp_path, **CAPS)
    monitor = Monitor(env, tmp_path / "monitor.log")
    try:
        monitor.wait_ready()
        baseline = series_count(monitor)
        rng = np.random.default_rng(0)
        traces = []
        for layer in range(LAYERS):
            header = make_header(wide, layer, np.array([1, 3]), 4)
            traces.append((header, uniform(header)))
        for c in invented:
            header = make_header(c, 0, np.array([1, 3]), 4)
            traces.append((header, uniform(header)))
        rng.shuffle(traces)
        send_traces(bootstrap, topics.traces, traces)
        monitor.wait_until(lambda: processed(monitor.metrics()) == len(traces), timeout=120,
                           what="every flooding trace accounted for")
        monitor.wait_until(lambda: monitor.value("attention_monitor_observations_judged_total") == len(traces),
                           timeout=120, what="every flooding trace judged (once its join's wait is over)")
        m = monitor.metrics()
        assert m["attention_monitor_layer_overflow_total"] > 0
        assert m["attention_monitor_label_overflow_total"] > 0
        assert m["attention_monitor_references_evicted_total"] >= LAYERS + REVISIONS - CAPS["max_references"] - 1
        layer_sets = {(k.split("layer=")[1].split(",")[0], k.split("model=")[1].split(",")[0],
                       k.split("revision=")[1].rstrip("}")) for k in m if k.startswith("attention_traces_total{")}
        assert len(layer_sets) <= CAPS["max_layer_series"] + CAPS["max_model_revisions"] + 1, sorted(layer_sets)[:10]
        grown = series_count(monitor) - baseline
        assert grown <= 104 * (len(layer_sets) + 1), grown  # the documented 104 series a layer, nothing more
    finally:
        monitor.process.stop()
    (state,) = (tmp_path / "state").glob("reference-*.json")
    assert len(json.loads(state.read_text())["references"]) <= CAPS["max_references"]
    assert state.stat().st_size < 200_000
