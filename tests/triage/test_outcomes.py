"""What the triage page and text say of outcomes: the revision against its judging
reference revision and the anomalous traces against the rest, each with its question,
with late outcomes and labels combined from the records."""

from __future__ import annotations

import re

import pytest

from monitor.triage import evidence, outcomes, page
from monitor.triage.text import report
from tests.triage.cases import records
from tests.triage.test_page import parse


def tally(success: int, failure: int, pending: int = 0, missing: int = 0, **extra: str) -> dict:
    return {"success": success, "failure": failure, "pending": pending, "missing": missing, **extra}


def anomaly(n: int, outcome: str, at: float, layer_tally: dict, reference: dict | None, revision: str = "canary",
            **extra: object) -> dict:
    return {"schema": "attention-anomaly/1", "trace_id": f"req-{n}/1", "request_id": f"req-{n}", "model_id": "m",
            "model_revision": revision, "contract_id": "c", "layer": 1, "kind": "sink_shift", "heads": ["h3"],
            "value": 0.9, "reference": 0.1, "reference_revision": "healthy", "effect_size": 9.0, "score": 5.0,
            "pages": True, "outcome": outcome, "detected_at": at, "layer_outcomes": layer_tally,
            "reference_outcomes": reference, **extra}


def late(n: int, outcome: str, at: float, layer_tally: dict, reference: dict, label: str | None = None,
         score: float | None = None) -> dict:
    return {"schema": "attention-outcome/1", "request_id": f"req-{n}", "model_id": "m", "model_revision": "canary",
            "reference_revision": "healthy", "outcome": outcome, "label": label, "score": score, "at": at,
            "layers": [{"layer": 0, "kinds": [], "layer_outcomes": tally(1, 1), "reference_outcomes": None},
                       {"layer": 1, "kinds": ["sink_shift"], "layer_outcomes": layer_tally,
                        "reference_outcomes": reference}]}


def test_the_issues_canary_its_reference_and_the_anomalous_subset_each_answer_their_question():
    """The canary of the issue: 57 of 160 canary traces failed, 26 of 216 of the healthy
    revision that judges it; the anomalous subset alone (19/49 against the other 38/111)
    says little. The revision contrast shows the harm."""
    reference = tally(190, 26, revision="healthy")
    recs = [anomaly(n, "failure" if n < 19 else "success", 100.0 + n, tally(103, 57), reference) for n in range(49)]
    found = outcomes.view(recs, recs, "m", "canary", 1)
    assert found is not None and found.revision is not None and found.anomalous is not None
    assert found.revision.group.rate == outcomes.Rate(57, 160)
    assert found.revision.baseline.rate == outcomes.Rate(26, 216)
    assert found.anomalous.group.rate == outcomes.Rate(19, 49)
    assert found.anomalous.baseline.rate == outcomes.Rate(38, 111)
    d_revision, d_anomalous = found.revision.difference, found.anomalous.difference
    assert d_revision[1] > 0.1  # the canary fails more: the interval of the difference is well above 0
    assert d_anomalous[1] < 0 < d_anomalous[2]  # the subset cannot tell
    html = page.render(evidence.for_layer(recs, "m", "canary", 1))
    cells = parse(html).cells
    assert (cells[("revision", "failures")], cells[("revision", "joined")]) == ("57", "160")
    assert (cells[("reference", "failures")], cells[("reference", "joined")]) == ("26", "216")
    low, high = outcomes.wilson(57, 160)
    assert cells[("revision", "interval")] == f"{low:.3f} – {high:.3f}"
    assert outcomes.REVISION_QUESTION in html and outcomes.ANOMALOUS_QUESTION in html
    assert 'id="outcome-intervals"' in html and "reference revision healthy" in html
    assert len(re.findall(r'<g id="interval-(revision|anomalous)-(group|baseline)"', html)) == 4


def test_late_outcomes_count_for_their_anomaly_records_with_their_labels_and_the_newest_tallies():
    """Anomaly records written with the outcome still awaited; three outcomes came late as
    their own records, the newest carrying the tallies after them."""
    reference = tally(20, 2, revision="healthy")
    recs = [anomaly(n, "pending", 100.0 + n, tally(4, 1, pending=6), reference) for n in range(6)]
    recs += [late(0, "failure", 200.0, tally(4, 2, pending=5), reference, label="thumbs_down", score=0.1),
             late(1, "failure", 201.0, tally(4, 3, pending=4), reference, label="regenerate"),
             late(2, "success", 202.0, tally(5, 3, pending=3), reference, label="thumbs_up", score=0.9)]
    recs.append(late(2, "failure", 203.0, tally(9, 9, pending=0), reference))  # a second one is never read
    case = evidence.for_layer(recs, "m", "canary", 1)
    found = case.outcomes
    assert found.anomalous.group.rate == outcomes.Rate(2, 3) and found.anomalous.group.pending == 3
    assert found.late == 3 and found.labels == {"thumbs_down": 1, "regenerate": 1, "thumbs_up": 1}
    assert found.score == (pytest.approx(0.5), 2)
    assert found.revision.group.rate == outcomes.Rate(3, 8) and found.revision.group.pending == 3
    assert found.anomalous.baseline.rate == outcomes.Rate(1, 5)
    html = page.render(case)
    assert 'data-label="thumbs_down"' in html and ">3</span> of their outcomes came after the join window" in html
    assert "<td>failure (late)</td>" in html and "<td>pending</td>" in html  # the strongest findings' outcomes
    text = report(case.records, [], recs)
    assert "outcomes: failure=2, pending=3, success=1" in text


def test_a_revision_that_judges_itself_has_no_reference_to_compare_and_says_how_to_get_one():
    recs = [anomaly(n, "failure", 100.0 + n, tally(3, 2), None, revision="canary") for n in range(2)]
    case = evidence.for_layer(recs, "m", "canary", 1)
    assert case.outcomes.revision.baseline is None
    html = page.render(case)
    assert "learns its own reference" in html and "attention-monitor reference pin" in html
    assert "no reference revision's counts" in "\n".join(outcomes.describe(case.outcomes))


def test_records_of_an_older_monitor_still_give_the_anomalous_subset():
    recs = [anomaly(n, "missing" if n == 0 else "failure", 100.0 + n, tally(5, 3, missing=2), None)
            for n in range(3)]
    for r in recs:
        del r["reference_outcomes"]
    found = evidence.for_layer(recs, "m", "canary", 1).outcomes
    assert found.anomalous.group.rate == outcomes.Rate(2, 2) and found.anomalous.group.missing == 1
    assert found.anomalous.baseline.rate == outcomes.Rate(1, 6)


def test_the_text_and_the_page_give_the_same_numbers_for_an_incident():
    recs = records()
    case = evidence.incident_cases(recs)[0]
    text = report(case.records, [case], recs)
    cells = parse(page.render(case)).cells
    for tag, group in (("revision", case.outcomes.revision.group), ("reference", case.outcomes.revision.baseline),
                       ("anomalous", case.outcomes.anomalous.group), ("others", case.outcomes.anomalous.baseline)):
        rate = group.rate
        assert (int(cells[(tag, "failures")]), int(cells[(tag, "joined")])) == (rate.failures, rate.joined)
        assert f"{group.name}: {rate.failures}/{rate.joined} failed = {rate.value:.3f}" in text
