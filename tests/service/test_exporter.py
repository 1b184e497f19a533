"""Bounded labels, and /metrics with TLS and basic auth."""

from __future__ import annotations

import base64
import ssl
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from monitor.core.detect import Verdict
from monitor.core.metrics import HeadMetrics
from monitor.service.exporter import MonitorMetrics
from monitor.service.http import MetricsServer


def measured(entropy, concentration, sink_share, diversity, effective_heads) -> HeadMetrics:
    """The metrics core's result for one trace of ``len(entropy)`` heads."""
    h = len(entropy)
    return HeadMetrics(np.array(entropy), np.array(concentration), np.array(sink_share), np.eye(h),
                       np.array(diversity), np.array(effective_heads))


def test_model_revisions_beyond_the_cap_go_to_other_and_are_counted():
    registry = CollectorRegistry()
    metrics = MonitorMetrics(registry, max_model_revisions=2)
    assert metrics.model_labels("m", "r1") == ("m", "r1")
    assert metrics.model_labels("m", "r2") == ("m", "r2")
    for i in range(50):  # a flood of invented model ids
        assert metrics.model_labels(f"invented-{i}", "x") == ("other", "other")
    assert metrics.model_labels("m", "r1") == ("m", "r1")
    assert registry.get_sample_value("attention_monitor_label_overflow_total") == 50


def test_allowlist_keeps_only_named_models():
    metrics = MonitorMetrics(CollectorRegistry(), model_allowlist=["prod-lm"])
    assert metrics.model_labels("prod-lm", "r") == ("prod-lm", "r")
    assert metrics.model_labels("someone-else", "r") == ("other", "other")


def test_head_series_only_at_head_detail():
    for level, expected in (("layer", None), ("head", 1.0)):
        registry = CollectorRegistry()
        metrics = MonitorMetrics(registry, detail_level=level)
        metrics.layer("m", "r", 0).observe_trace(["h0", "h1"], measured([0.5, 0.6], [0.4, 0.3], [0.1, 0.2], 0.7, 1.8))
        labels = {"model": "m", "revision": "r", "layer": "0", "head": "h0"}
        assert registry.get_sample_value("attention_head_entropy_count", labels) == expected
        assert registry.get_sample_value("attention_layer_entropy_sum", {"model": "m", "revision": "r",
                                                                         "layer": "0"}) == pytest.approx(0.55)


def _cert(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def _get(url, context=None, auth=None):
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    with urllib.request.urlopen(request, timeout=5, context=context) as resp:
        return resp.status, resp.read().decode()


def test_metrics_over_tls_with_basic_auth(tmp_path):
    cert, key = _cert(tmp_path)
    registry = CollectorRegistry()
    MonitorMetrics(registry)
    ready = {"now": False}
    server = MetricsServer(registry, port=0, tls_cert=cert, tls_key=key, basic_auth=("prom", "s3cret"),
                           ready=lambda: ready["now"]).start()
    context = ssl.create_default_context(cafile=str(cert))
    try:
        assert server.url.startswith("https://")
        status, body = _get(f"{server.url}/metrics", context, auth="prom:s3cret")
        assert status == 200 and "attention_monitor_traces_consumed_total" in body
        with pytest.raises(urllib.error.HTTPError) as denied:
            _get(f"{server.url}/metrics", context, auth="prom:wrong")
        assert denied.value.code == 401
        with pytest.raises(urllib.error.HTTPError):
            _get(f"{server.url}/metrics", context)
        assert _get(f"{server.url}/healthz", context) == (200, "ok\n")  # probes need no credentials
        with pytest.raises(urllib.error.HTTPError) as not_ready:
            _get(f"{server.url}/readyz", context)
        assert not_ready.value.code == 503
        ready["now"] = True
        assert _get(f"{server.url}/readyz", context)[0] == 200
        with pytest.raises(OSError):
            _get(f"{server.url.replace('https', 'http')}/metrics")  # plaintext is refused
        assert _get(f"{server.url}/healthz", context) == (200, "ok\n")  # and the server carries on
    finally:
        server.stop()


def test_series_per_model_revision_follow_the_documented_formula():
    import prometheus_client

    prometheus_client.disable_created_metrics()
    try:
        def series(level, layers, heads):
            registry = CollectorRegistry()
            metrics = MonitorMetrics(registry, detail_level=level)
            before = sum(len(f.samples) for f in registry.collect())
            for layer in range(layers):
                series = metrics.layer("m", "r", layer)
                series.observe_trace([f"h{i}" for i in range(heads)],
                                     measured([0.5] * heads, [0.5] * heads, [0.5] * heads, 0.5, 2.0))
                for kind in ("low_diversity", "sink_shift"):
                    series.observe_anomaly(kind)
                series.observe_joined("failure")
                series.observe_judged("failure", ["low_diversity"])
                series.observe_verdict(Verdict([], "r0", False, 100, True))
                series.observe_verdict(Verdict([], None, True, 3, False))
            return sum(len(f.samples) for f in registry.collect()) - before

        for layers, heads in ((1, 1), (3, 4), (32, 32)):
            assert series("layer", layers, heads) == 104 * layers
            assert series("head", layers, heads) == 104 * layers + 27 * layers * heads
    finally:
        prometheus_client.enable_created_metrics()


def test_layers_beyond_the_cap_are_labelled_other_and_counted():
    registry = CollectorRegistry()
    metrics = MonitorMetrics(registry, max_layer_series=3)
    for layer in range(10):  # a contract declaring many layers cannot grow the series without bound
        metrics.layer("m", "r", layer).observe_trace(["h0"], measured([0.5], [0.5], [0.5], float("nan"), 1.0))
    layers = {s.labels["layer"] for f in registry.collect() if f.name == "attention_traces" for s in f.samples}
    assert layers == {"0", "1", "2", "other"}
    assert registry.get_sample_value("attention_traces_total", {"model": "m", "revision": "r", "layer": "other"}) == 7
    assert registry.get_sample_value("attention_monitor_layer_overflow_total") == 7
