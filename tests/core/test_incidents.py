"""Incidents: only evidence that crossed the page threshold opens one; one incident per
fault of a revision, its primary layer fixed, other layers annotated; one account of the
heads involved, counted from the evidence before the page on, that never drops a head;
closed after quiet."""

from __future__ import annotations

import itertools
import json

import pytest

from monitor.core.detect import Anomaly
from monitor.core.incidents import ACCOUNT_REFRESH_S, HANDED_OVER, HeadAccount, IncidentTracker


def anomaly(kind, heads, effect=5.0, layer=2, pages=False):
    return Anomaly(kind, layer, tuple(heads), 0.2, 0.4, effect, 12.0, "r1", pages)


def observe(tracker, anomalies, now, layer=2):
    records = [{"kind": a.kind, "effect_size": a.effect, "heads": list(a.heads)} for a in anomalies]
    return tracker.observe("m", "r2", layer, anomalies, records, now, 1_700_000_000 + now)


def test_findings_below_the_page_threshold_stay_evidence_and_open_nothing():
    tracker = IncidentTracker(quiet=600)
    for t in range(20):
        assert observe(tracker, [anomaly("low_diversity", ["head-1"]), anomaly("sink_shift", ["head-3"])], now=t) == []
    assert not tracker.open


def test_a_collapse_is_one_incident_naming_the_heads_that_recur_and_its_side_effects():
    tracker = IncidentTracker(quiet=600)
    assert observe(tracker, [anomaly("low_diversity", ["head-1", "head-2", "head-5"])], now=0) == []  # evidence
    changes = observe(tracker, [anomaly("low_diversity", ["head-1", "head-2"], pages=True),
                                anomaly("entropy_collapse", ["head-1"])], now=1)
    assert [(c.what, c.incident.key, c.incident.layer, c.incident.family) for c in changes] == [
        ("opened", ("m", "r2"), 2, "diversity")]
    for t in range(2, 11):
        assert observe(tracker, [anomaly("low_diversity", ["head-1", "head-2", "head-5" if t == 5 else "head-1"],
                                         effect=4 + t),
                                 anomaly("concentration_spike", ["head-2"])], now=t) == []
    (incident,) = tracker.open.values()
    assert incident.involved() == ["head-1", "head-2"]  # head-5 came up in two of eleven traces
    # the finding before the page is the incident's evidence too
    assert incident.anomalies == 11 and incident.traces == 11
    assert incident.summary()["head_counts"] == {"head-1": 11, "head-2": 11, "head-5": 2}
    assert incident.side_effects == {"entropy_collapse": 1, "concentration_spike": 9}
    assert incident.strongest["effect_size"] == 14
    assert tracker.expire(now=500) == []
    (closed,) = tracker.expire(now=611)
    assert closed.what == "closed" and closed.incident.summary()["state"] == "closed"
    assert not tracker.open


def test_other_layers_of_the_revision_are_annotations_of_the_first_page_never_pages_of_their_own():
    tracker = IncidentTracker(quiet=600)
    (opened,) = observe(tracker, [anomaly("sink_shift", ["head-3"], layer=1, pages=True)], now=0, layer=1)
    assert (opened.incident.layer, opened.incident.family) == (1, "head")
    # downstream layers change too, through the residual stream, paging or not
    (updated,) = observe(tracker, [anomaly("low_diversity", ["head-2"], layer=2)], now=1)
    assert updated.what == "updated"
    assert observe(tracker, [anomaly("low_diversity", ["head-2"], layer=2)], now=2) == []  # counted only
    (paged,) = observe(tracker, [anomaly("low_diversity", ["head-2"], layer=2, pages=True)], now=3)
    assert paged.what == "updated"  # its page is an annotation, not a second incident
    assert observe(tracker, [anomaly("entropy_collapse", ["head-0"], layer=0, pages=True)], now=4,
                   layer=0)[0].what == "updated"
    (incident,) = tracker.open.values()
    assert (incident.layer, incident.family) == (1, "head")  # the primary never moves: one alert, one page
    assert incident.summary()["also_changed"] == [
        {"layer": 0, "relation": "upstream", "findings": 1, "paged": True, "kinds": {"entropy_collapse": 1}},
        {"layer": 2, "relation": "downstream", "findings": 3, "paged": True, "kinds": {"low_diversity": 3}}]
    # findings on any layer keep the incident open
    assert tracker.expire(now=550) == []
    observe(tracker, [anomaly("low_diversity", ["head-2"], layer=2)], now=590)
    assert tracker.expire(now=1000) == []


def test_a_diversity_page_leads_when_one_trace_pages_both_families():
    tracker = IncidentTracker(quiet=600)
    (opened,) = observe(tracker, [anomaly("sink_shift", ["head-3"], pages=True),
                                  anomaly("low_diversity", ["head-3", "head-4"], pages=True)], now=0)
    assert opened.incident.family == "diversity"
    assert opened.incident.side_effects == {"sink_shift": 1}


def test_revisions_have_incidents_of_their_own_and_the_count_is_bounded():
    tracker = IncidentTracker(quiet=600, max_open=2)
    for revision in ("a", "b", "c"):
        tracker.observe("m", revision, 1, [anomaly("sink_shift", ["head-3"], pages=True)], [{}], 0.0, 0.0)
    assert set(tracker.open) == {("m", "a"), ("m", "b")}  # beyond the cap, findings stay evidence


def test_an_incident_taken_over_by_another_tracker_stays_one_incident():
    """JUDGING=fleet: the incident of a fault that goes on moves with its judge's
    partition; the new tracker (another clock) updates it, pages nothing new, and closes
    it after the same quiet period."""
    tracker = IncidentTracker(quiet=600)
    observe(tracker, [anomaly("low_diversity", ["head-1"], pages=True)], now=100)
    observe(tracker, [anomaly("sink_shift", ["head-3"])], now=150, layer=3)  # an annotation
    moved = IncidentTracker(quiet=600)
    moved.restore(json.loads(json.dumps(tracker.state([("m", "r2"), ("m", "other")], now=160))), now=5_000)
    (before,), (after,) = tracker.open.values(), moved.open.values()
    assert after.summary() == before.summary()  # the same id, counts, annotation, strongest finding
    # no new page (an updated record at most: its account changed, and its last record is old)
    assert [c.what for c in observe(moved, [anomaly("low_diversity", ["head-1"], pages=True)], now=5_010)] == [
        "updated"]
    assert moved.open[("m", "r2")].anomalies == 2
    assert moved.expire(now=5_609) == [] and [c.what for c in moved.expire(now=5_610)] == ["closed"]


def test_an_incident_handed_over_closes_here_without_a_record_and_is_taken_back_by_a_restore():
    tracker = IncidentTracker(quiet=600)
    observe(tracker, [anomaly("low_diversity", ["head-1"], pages=True)], now=100)
    state = tracker.state([("m", "r2")], now=200)
    tracker.hand_over([("m", "r2"), ("m", "never-open")])
    assert tracker.handed == {("m", "r2")}
    assert tracker.expire(now=699) == []  # open here until quiet, like any other
    assert [(c.what, c.reason) for c in tracker.expire(now=700)] == [("closed", HANDED_OVER)]
    assert tracker.handed == set()
    tracker.restore(state, now=800)  # the partition came back: its incident is this tracker's again
    tracker.hand_over([("m", "r2")])
    tracker.restore(state, now=900)
    assert [(c.what, c.reason) for c in tracker.expire(now=1_400)] == [("closed", "")]


def test_the_heads_account_names_a_head_once_supported_and_never_drops_it():
    account = HeadAccount()
    assert not account.add(["head-1", "head-2", "head-9"])  # one trace alone names nothing
    assert account.add(["head-1", "head-2", "head-2"]) and account.heads() == ["head-1", "head-2"]
    for _ in range(6):  # head-2 stops being named by the findings: it stays named, with its count
        account.add(["head-1", "head-7"])
    assert account.heads() == ["head-1", "head-7", "head-2"]  # head-7: 6 of 8 traces
    assert account.to_dict() == {"heads": ["head-1", "head-7", "head-2"], "traces": 8,
                                 "head_counts": {"head-1": 8, "head-7": 6, "head-2": 2, "head-9": 1}}
    assert HeadAccount.from_dict({**account.to_dict(), "named": account.named}) == account


@pytest.mark.parametrize("noise", [0, 1, 2])
def test_an_incident_names_every_head_it_once_named_as_evidence_accrues(noise):
    """Findings name a varying subset of the changed heads (as real ones do): the heads
    named only grow, each is named by a record, and the record's heads are exactly the
    account's."""
    import random

    rng = random.Random(noise)
    tracker = IncidentTracker(quiet=600)
    changed = ["head-1", "head-2", "head-7", "head-10"]
    named: list[str] = []
    records: list[dict] = []
    for t in range(60):
        heads = [h for h in changed if rng.random() < 0.7] + [f"head-{rng.randrange(12)}" for _ in range(noise)]
        records += [c.incident.summary() for c in observe(
            tracker, [anomaly("low_diversity", heads or ["head-2"], pages=t >= 5)], now=t)]
        (incident,) = tracker.open.values() or (None,)
        if incident is not None:
            assert set(named) <= set(incident.involved())
            named = incident.involved()
    assert set(changed) <= set(named)
    assert set(records[-1]["heads"]) == set(named)  # a record at once whenever a head is named
    assert all(set(a["heads"]) <= set(b["heads"]) for a, b in itertools.pairwise(records))


def test_records_follow_the_account_heads_at_once_counts_at_most_every_refresh():
    tracker = IncidentTracker(quiet=600)
    observe(tracker, [anomaly("sink_shift", ["head-3"])], now=0)
    (opened,) = observe(tracker, [anomaly("sink_shift", ["head-3"], pages=True)], now=1)
    assert opened.what == "opened" and opened.incident.summary()["heads"] == ["head-3"]
    assert opened.incident.evidence_since == 1_700_000_000  # the finding before the page
    assert observe(tracker, [anomaly("sink_shift", ["head-5"]), anomaly("entropy_collapse", ["head-5"])], now=2) == []
    (named,) = observe(tracker, [anomaly("sink_shift", ["head-5"])], now=3)
    assert (named.what, named.reason) == ("updated", "heads")  # 2 of 4 traces name head-5: at once
    assert named.incident.summary()["heads"] == ["head-3", "head-5"]
    assert observe(tracker, [anomaly("sink_shift", ["head-3"])], now=4) == []  # more evidence: not yet
    (refresh,) = observe(tracker, [anomaly("sink_shift", ["head-3"])], now=3 + ACCOUNT_REFRESH_S)
    assert (refresh.what, refresh.reason) == ("updated", "account")
    assert refresh.incident.summary()["head_counts"] == {"head-3": 4, "head-5": 2}
    assert refresh.incident.summary()["anomalies"] == 7


def test_evidence_of_another_layer_or_family_or_too_old_is_not_counted_when_an_incident_opens():
    tracker = IncidentTracker(quiet=600)
    observe(tracker, [anomaly("low_diversity", ["head-8"])], now=0)  # too old by the page
    observe(tracker, [anomaly("low_diversity", ["head-9"], layer=3)], now=700, layer=3)
    observe(tracker, [anomaly("sink_shift", ["head-9"])], now=701)
    observe(tracker, [anomaly("low_diversity", ["head-1", "head-2"])], now=702)
    (opened,) = observe(tracker, [anomaly("low_diversity", ["head-1", "head-2"], pages=True)], now=703)
    assert opened.incident.summary()["head_counts"] == {"head-1": 2, "head-2": 2}
    assert opened.incident.involved() == ["head-1", "head-2"]
