"""Incidents: one page per fault, the heads really involved, closed after quiet."""

from __future__ import annotations

from monitor.core.detect import Anomaly
from monitor.core.incidents import IncidentTracker


def anomaly(kind, heads, effect=5.0, layer=2):
    return Anomaly(kind, layer, tuple(heads), 0.2, 0.4, effect, 12.0, "r1")


def observe(tracker, anomalies, now, layer=2):
    records = [{"kind": a.kind, "effect_size": a.effect, "heads": list(a.heads)} for a in anomalies]
    return tracker.observe("m", "r2", layer, anomalies, records, now, 1_700_000_000 + now)


def test_a_collapse_is_one_incident_naming_the_heads_that_recur_and_its_side_effects_open_nothing():
    tracker = IncidentTracker(quiet=600)
    changes = observe(tracker, [anomaly("low_diversity", ["head-1", "head-2", "head-5"]),
                                anomaly("entropy_collapse", ["head-1"])], now=0)
    assert [(c.what, c.incident.key[3]) for c in changes] == [("opened", "diversity")]
    for t in range(1, 10):
        assert observe(tracker, [anomaly("low_diversity", ["head-1", "head-2"], effect=4 + t),
                                 anomaly("concentration_spike", ["head-2"])], now=t) == []
    (incident,) = tracker.open.values()
    assert incident.involved() == ["head-1", "head-2"]  # head-5 came up once in ten findings
    assert incident.anomalies == 10 and incident.traces == 10
    assert incident.side_effects == {"entropy_collapse": 1, "concentration_spike": 9}
    assert incident.strongest["effect_size"] == 13
    assert tracker.expire(now=500) == []
    (closed,) = tracker.expire(now=609)
    assert closed.what == "closed" and closed.incident.summary()["state"] == "closed"
    assert not tracker.open


def test_a_head_incident_is_closed_into_the_diversity_incident_that_follows():
    tracker = IncidentTracker(quiet=600)
    (opened,) = observe(tracker, [anomaly("sink_shift", ["head-3"])], now=0)
    assert opened.incident.key == ("m", "r2", 2, "head")
    changes = observe(tracker, [anomaly("low_diversity", ["head-3", "head-4"])], now=5)
    assert [(c.what, c.incident.key[3]) for c in changes] == [("opened", "diversity"), ("closed", "head")]
    assert changes[1].incident.merged_into == changes[0].incident.id
    assert changes[0].incident.side_effects == {"sink_shift": 1}


def test_a_sink_on_another_layer_is_its_own_incident():
    tracker = IncidentTracker(quiet=600)
    observe(tracker, [anomaly("low_diversity", ["head-1", "head-2"])], now=0)
    (other,) = observe(tracker, [anomaly("sink_shift", ["head-3"], layer=1)], now=1, layer=1)
    assert other.what == "opened" and other.incident.key == ("m", "r2", 1, "head")
    assert len(tracker.open) == 2
