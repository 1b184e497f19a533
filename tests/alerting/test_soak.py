"""The short version of the healthy soak (benchmarks/soak.py): a real checkpoint on real
text of realistic lengths, through the broker, the service with its defaults, the shipped
rules in Prometheus and the shipped routes in Alertmanager. Healthy traffic pages
nothing; a collapsed layer pages once, within two minutes at 0.5 requests/s, naming its
layer and heads; a quantised copy of the weights pages nothing."""

from __future__ import annotations

import pytest

from benchmarks.faults import COLLAPSE
from benchmarks.soak import run

pytestmark = [pytest.mark.kafka, pytest.mark.prometheus, pytest.mark.models]


def test_healthy_traffic_of_a_real_checkpoint_pages_nothing_and_a_collapse_pages_once(tmp_path):
    result = run(healthy=800, fault_names=("collapse", "benign"), workdir=tmp_path, fault_requests=45, seed=3)
    assert result["healthy_judged"] == 600
    assert (result["pages"], result["incidents"]) == (0, 0)
    assert result["findings"] <= 1  # evidence, which pages nothing anyway
    assert result["margin"] < 1.0  # no stream's page statistic reached its threshold
    collapse = result["faults"]["collapse"]
    layer, heads, source = COLLAPSE
    assert collapse.first_finding is not None and collapse.first_finding < 10
    assert collapse.pages == 1 and collapse.page_seconds is not None and collapse.page_seconds < 120
    assert collapse.layer == layer and set(collapse.heads) == {f"head-{h}" for h in (source, *heads)}
    benign = result["faults"]["benign"]
    assert (benign.pages, benign.first_finding) == (0, None)
