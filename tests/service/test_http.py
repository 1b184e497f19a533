"""The triage pages over the monitor's HTTP endpoint: each with its own status."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from monitor.service.http import MetricsServer
from monitor.triage import site
from tests.triage.cases import records


def test_triage_pages_are_served_with_their_status_as_html():
    recs = records()
    server = MetricsServer(CollectorRegistry(), port=0, pages=lambda path, query: site.respond(recs, path, query))
    server.start()
    try:
        with urllib.request.urlopen(f"{server.url}/triage/", timeout=30) as resp:
            assert resp.status == 200 and "Incidents" in resp.read().decode()
        for path, status, says in (("/triage/layer?model=scenario-lm&revision=r1", 400, "layer is missing"),
                                   ("/triage/incident/nope", 404, "No incident")):
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(server.url + path, timeout=30)
            assert answer.value.code == status
            assert answer.value.headers["content-type"] == "text/html; charset=utf-8"
            assert "default-src 'none'" in answer.value.headers["content-security-policy"]
            assert says in answer.value.read().decode()
    finally:
        server.stop()
