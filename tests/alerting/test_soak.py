"""The short version of the healthy soak (benchmarks/soak.py): a real checkpoint on real
text of realistic lengths, through the broker, the service with its defaults, the shipped
rules in Prometheus (scraping the monitor every 5 s, as shipped) and the shipped page
route in Alertmanager. Healthy traffic pages nothing; three heads of layer 4 copying a
fourth page once, within 30 s of the evidence crossing the page threshold and 45 s of the
fault's first request at 0.5 requests/s, and every surface (the incident record, the
alert, the page as delivered, the triage page, the triage text) names the same heads; a
quantised copy of the weights pages nothing."""

from __future__ import annotations

import pytest

from benchmarks.faults import COPY
from benchmarks.soak import run

pytestmark = [pytest.mark.kafka, pytest.mark.prometheus, pytest.mark.models]


def test_healthy_traffic_pages_nothing_and_a_three_head_copy_pages_once_naming_the_same_heads_everywhere(tmp_path):
    result = run(healthy=800, fault_names=("copy", "benign"), workdir=tmp_path, fault_requests=40, seed=3)
    assert result["healthy_judged"] == 600
    assert (result["pages"], result["incidents"]) == (0, 0)
    assert result["findings"] <= 1  # evidence, which pages nothing anyway
    assert result["margin"] < 1.0  # no stream's page statistic reached its threshold
    copy = result["faults"]["copy"]
    layer, heads, _source = COPY
    assert copy.first_finding is not None and copy.first_finding < 12
    assert copy.pages == 1 and copy.layer == layer
    assert copy.crossing_seconds is not None and copy.crossing_seconds < 30, copy
    assert copy.page_seconds is not None and copy.page_seconds < 45, copy
    named = set(copy.heads)
    assert {f"head-{h}" for h in heads} <= named <= {f"head-{h}" for h in range(12)}, copy
    surfaces = copy.surfaces
    assert set(surfaces) == {"record", "alert", "page as delivered", "triage page", "triage text"}, surfaces
    for surface in ("record", "alert", "triage page", "triage text"):
        assert set(surfaces[surface]) == named, (surface, surfaces)
    assert surfaces["triage page"] == surfaces["record"] == surfaces["triage text"]  # best supported first
    assert set(surfaces["page as delivered"]) <= named  # then; a head once named stays named
    benign = result["faults"]["benign"]
    assert (benign.pages, benign.first_finding) == (0, None)
