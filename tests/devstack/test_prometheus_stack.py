"""The real Prometheus scrapes what a test chooses; Alertmanager runs on the repo config."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from devstack.process import free_port
from devstack.prometheus import get_json
from devstack.wait import wait_for

pytestmark = pytest.mark.prometheus


def test_prometheus_scrapes_a_test_exporter(prometheus_stack):
    registry = CollectorRegistry()
    Gauge("devstack_probe_value", "A value the test sets.", registry=registry).set(42.5)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        stack = prometheus_stack({"probe": [f"127.0.0.1:{port}"]})
        result = wait_for(lambda: stack.prometheus.query('devstack_probe_value{job="probe"}'),
                          timeout=20, what="the probe gauge in Prometheus")
        assert float(result[0]["value"][1]) == 42.5
        assert stack.prometheus.query('up{job="probe"} == 1')
        # Prometheus knows the Alertmanager the stack started.
        ams = wait_for(lambda: stack.prometheus.api("alertmanagers")["activeAlertmanagers"],
                       timeout=20, what="an active Alertmanager")
        assert ams[0]["url"].startswith(stack.alertmanager.url)
        assert get_json(f"{stack.alertmanager.url}/api/v2/status")["cluster"]["status"] == "disabled"
    finally:
        server.shutdown()
        thread.join()
