"""The layers the serving instance has seen, from its own metrics, on the triage pages:
a layer nobody saw is a 404 (a typo is not a healthy layer), a healthy layer names its
judge and its contract, and the index links every layer seen to its page."""

from __future__ import annotations

import re

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from monitor.core.detect import Detector, DetectorConfig, Observation
from monitor.core.metrics import head_metrics
from monitor.protocol.codec import valid_keys
from monitor.service.exporter import MonitorMetrics
from monitor.triage import page, seen, site
from tests.triage.cases import COLLAPSED, HEALTHY, records
from tests.triage.test_page import parse


@pytest.fixture(scope="module")
def served():
    """The records, and the layers an instance that measured their traces has seen."""
    registry = CollectorRegistry()
    recs = records(metrics=MonitorMetrics(registry))
    return recs, seen.from_metrics(registry.collect(), [HEALTHY.contract(), COLLAPSED.contract()])


def test_every_layer_measured_is_seen_with_its_judge_reference_contract_and_findings(served):
    _, layers = served
    layer_count = len(HEALTHY.contract().layers)
    assert list(layers) == sorted(("scenario-lm", r, n) for r in ("r1", "r2") for n in range(layer_count))
    learnt = layers[("scenario-lm", "r1", 0)]  # its 100 traces taught its reference; none was judged yet
    assert (learnt.judged_by, learnt.ready, learnt.traces, learnt.unjudged) == (None, True, 100, {"learning": 100})
    assert learnt.contract_ids == [HEALTHY.contract().contract_id]
    healthy = layers[("scenario-lm", "r2", 0)]  # the canary's healthy layer, judged by r1's reference (a pin)
    assert (healthy.judged_by, healthy.ready, healthy.traces, healthy.findings) == ("r1", True, 20, 0)
    assert healthy.reference == "ready (100 traces)" and healthy.incidents == []
    collapsed = layers[("scenario-lm", "r2", 2)]
    assert collapsed.judged_by == "r1" and collapsed.findings > 0 and collapsed.incidents == ["diversity"]
    assert collapsed.contract_ids == [COLLAPSED.contract().contract_id]


def test_a_layer_no_trace_or_record_names_is_a_404_listing_the_layers_seen(served):
    recs, layers = served
    status, html = site.respond(recs, "layer", "model=nosuch&revision=x&layer=9", layers)
    assert status == 404 and "Nothing to investigate" not in html
    assert "no traces of model &#39;nosuch&#39; revision &#39;x&#39; layer 9" in html
    links = re.findall(r'href="(layer\?[^"]+)"', html)
    assert len(links) == len(layers)
    assert page.layer_href("scenario-lm", "r1", 0).replace("&", "&amp;") in links
    # a typo of a layer number alone is as unknown
    assert site.respond(recs, "layer", "model=scenario-lm&revision=r1&layer=99", layers)[0] == 404


def test_a_healthy_layer_names_the_reference_that_judges_it_and_its_contract(served):
    """No anomaly record names them on a healthy layer: the instance's metrics and
    contracts do."""
    recs, layers = served
    status, html = site.respond(recs, "layer", "model=scenario-lm&revision=r2&layer=0", layers)
    cells = parse(html).cells
    assert status == 200 and "Nothing to investigate" in html
    assert cells[(None, "reference_revision")] == "r1" and "as this instance judges the layer now" in html
    assert cells[(None, "contract_id")] == COLLAPSED.contract().contract_id
    assert cells[(None, "reference_state")] == "ready (100 traces)" and cells[(None, "traces_seen")] == "20"
    # a reference its own traces just made ready has judged nothing yet: no green verdict either
    _, html = site.respond(recs, "layer", "model=scenario-lm&revision=r1&layer=0", layers)
    assert "Nothing to investigate" not in html and "none was judged yet" in html
    assert parse(html).cells[(None, "contract_id")] == HEALTHY.contract().contract_id
    # the records' own say wins where they have one: the collapse was judged against r1
    _, html = site.respond(recs, "layer", "model=scenario-lm&revision=r2&layer=2", layers)
    assert parse(html).cells[(None, "reference_revision")] == "r1"


def test_a_layer_whose_reference_is_learning_is_not_called_healthy():
    """No finding can be raised before a reference is ready: no green verdict then."""
    metrics = MonitorMetrics(CollectorRegistry())
    detector = Detector(DetectorConfig(reference_traces=100))
    rng = np.random.default_rng(0)
    for n in range(10):
        for header, weights in HEALTHY.request(rng, request_id=f"req-{n}"):
            m = head_metrics(weights, valid_keys(header))
            series = metrics.layer(header.model_id, header.model_revision, header.layer)
            series.observe_trace(header.heads, m)
            series.observe_verdict(detector.observe(Observation(header.model_id, header.model_revision, header.layer,
                                                                header.key_count, header.heads, m)))
    layers = seen.from_metrics(metrics.registry.collect())
    status, html = site.respond([], "layer", "model=scenario-lm&revision=r1&layer=0", layers)
    assert status == 200 and "Nothing to investigate" not in html
    assert "Not judged here yet: the reference is learning (10 traces)" in html
    assert parse(html).cells[(None, "reference_revision")] == "–"  # none judges it yet


def test_the_index_links_every_layer_seen_with_its_state(served):
    recs, layers = served
    status, html = site.respond(recs, "", "", layers)
    assert status == 200
    table = html[html.index('<table id="layers-seen">'):]
    table = table[:table.index("</table>")]
    for layer in layers.values():
        row = table[table.index(f'data-layer="{layer.model} {layer.revision} {layer.layer}"'):].split("</tr>")[0]
        assert page.layer_href(layer.model, layer.revision, layer.layer).replace("&", "&amp;") in row
        assert f'data-field="findings">{layer.findings}<' in row and f'data-field="reference">{layer.reference}<' in row
    assert "diversity" in table  # the collapsed layer's open incident
    assert site.respond(recs, "", "", {})[1].count("None yet: this instance has measured no trace") == 1
