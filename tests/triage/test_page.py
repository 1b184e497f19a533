"""The triage page from records the real detector and incident tracker made: what it
names, what it draws, and that its numbers are the records' numbers."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
from scipy.stats import binomtest

from monitor.core.detect import Detector, DetectorConfig
from monitor.core.reference import LengthReference
from monitor.triage import evidence, page, site
from monitor.triage.evidence import wilson
from tests.triage.cases import COLLAPSED_HEADS, records


@pytest.fixture(scope="module")
def collapsed():
    recs = records()
    incident = evidence.incidents(recs)[0]
    return recs, incident, evidence.for_incident(recs, incident["incident_id"])


class Cells(HTMLParser):
    """Text of every element with a data-field, by the data-finding or data-group of its row."""

    def __init__(self) -> None:
        super().__init__()
        self.row: str | None = None
        self.field: str | None = None
        self.cells: dict[tuple[str | None, str], str] = {}
        self.heads: list[str] = []
        self._head = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr":
            self.row = a.get("data-finding") or a.get("data-group")
        if "data-field" in a:
            self.field = a["data-field"]
            self.cells[(self.row, self.field)] = ""
        self._head = "data-head" in a

    def handle_endtag(self, tag):
        if tag in ("td", "span"):
            self.field = None
        self._head = False

    def handle_data(self, data):
        if self.field is not None:
            self.cells[(self.row, self.field)] += data
        if self._head:
            self.heads.append(data)


def parse(html: str) -> Cells:
    cells = Cells()
    cells.feed(html)
    return cells


def test_a_collapse_names_its_heads_and_draws_them_against_the_reference(collapsed):
    _, incident, case = collapsed
    assert incident["family"] == "diversity" and incident["model_revision"] == "r2" and incident["layer"] == 2
    assert set(case.involved) == COLLAPSED_HEADS
    html = page.render(case)
    cells = parse(html)
    assert set(cells.heads) == COLLAPSED_HEADS
    svg = html[html.index('<figure id="heatmaps">'):html.index("</figure>")]
    assert all(f">head-{h}<" in svg for h in range(8))  # head ids on the axes, as text
    outlined = set(re.findall(r'<g id="involved-(head-\d)-(head-\d)"', svg))
    assert outlined == {(a, b) for a in COLLAPSED_HEADS for b in COLLAPSED_HEADS if a != b}
    assert all(f'id="heatmap-{name}"' in svg for name in ("this", "reference", "difference"))
    assert 'id="timelines"' in html
    assert "prune" not in html.lower().replace("not an automatic pruning command", "")
    assert "attention-monitor study" in html


def test_the_pages_numbers_are_the_records_numbers(collapsed):
    *_, case = collapsed
    cells = parse(page.render(case))
    strongest = case.strongest
    assert strongest and len(strongest) <= evidence.STRONGEST
    assert {r["kind"] for r in strongest} == {"low_diversity"}  # the incident's evidence, not its side effects
    assert [r["effect_size"] for r in strongest] == sorted((r["effect_size"] for r in case.evidence), reverse=True)[
        :len(strongest)]
    for r in strongest:
        row = f"{r['trace_id']} {r['kind']} {','.join(r['heads'])}"
        assert float(cells.cells[(row, "value")]) == pytest.approx(r["value"], abs=5e-5)
        assert float(cells.cells[(row, "reference")]) == pytest.approx(r["reference"], abs=5e-5)
        assert float(cells.cells[(row, "effect_size")]) == pytest.approx(r["effect_size"], abs=5e-3)
        assert float(cells.cells[(row, "score")]) == pytest.approx(r["score"], abs=5e-3)
    assert int(cells.cells[(None, "anomalies")]) == case.incident["anomalies"]
    assert int(cells.cells[(None, "traces")]) == case.incident["traces"] == case.evidence_traces
    latest = case.latest["evidence"]
    assert float(cells.cells[(None, "diversity")]) == pytest.approx(latest["diversity"]["value"], abs=5e-4)

    outcome = {r["trace_id"]: r["outcome"] for r in case.records}
    failures = sum(o == "failure" for o in outcome.values())
    assert int(cells.cells[("anomalous", "failures")]) == failures
    assert int(cells.cells[("anomalous", "joined")]) == len(outcome)
    layer = max(case.records, key=lambda r: r["detected_at"])["layer_outcomes"]
    assert int(cells.cells[("others", "joined")]) == layer["success"] + layer["failure"] - len(outcome)


def test_a_healthy_layer_says_there_is_nothing_to_investigate(collapsed):
    recs, _, _ = collapsed
    case = evidence.for_layer(recs, "scenario-lm", "r1", 2)
    assert case.healthy
    html = page.render(case)
    assert "Nothing to investigate" in html and "<svg" not in html


def test_pages_are_self_contained():
    html = page.render(evidence.for_incident(records(), evidence.incidents(records())[0]["incident_id"]))
    assert not re.search(r"<(script|link|iframe|img)\b", html)
    assert not re.search(r'(src|href)="(https?:)?//', html)
    assert "@import" not in html and not re.search(r"url\((?!#)", html)  # only the SVG's own clip paths


def test_the_site_routes_and_refuses_what_it_does_not_know(collapsed):
    recs, incident, _ = collapsed
    status, index = site.respond(recs, "", "")
    assert status == 200 and page.incident_href(incident["incident_id"]) in index
    status, html = site.respond(recs, page.incident_href(incident["incident_id"]), "")
    assert status == 200 and "Incident " in html
    status, html = site.respond(recs, "layer", "model=scenario-lm&revision=r1&layer=0")
    assert status == 200 and "Nothing to investigate" in html
    status, html = site.respond(recs, "incident/nope", "")
    assert status == 404 and "No incident &#39;nope&#39;" in html and 'href="../"' in html
    status, html = site.respond(recs, "elsewhere", "")
    assert status == 404 and "There is no triage page &#39;elsewhere&#39;" in html and 'href="./"' in html


@pytest.mark.parametrize(("query", "named"), [
    ("", "model, revision and layer are missing"),
    ("model=m", "revision and layer are missing (given: model=m)"),
    ("model=m&revision=r", "layer is missing (given: model=m, revision=r)"),
    ("model=m&revision=&layer=2", "revision is missing"),
    ("model=m&revision=r&layer=x", "layer must be a layer number (0, 1, …), got &#39;x&#39;"),
])
def test_a_layer_address_without_its_parameters_is_a_bad_request_naming_them(collapsed, query, named):
    """400, not 404: the page exists, the address lacks what it needs; it names what."""
    status, html = site.respond(collapsed[0], "layer", query)
    assert status == 400 and named in html and "Nothing to investigate" not in html
    assert 'href="./"' in html  # back to the index


@pytest.mark.parametrize(("k", "n"), [(0, 5), (3, 10), (17, 40), (40, 40)])
def test_failure_rate_intervals_are_wilsons(k, n):
    expected = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert wilson(k, n) == pytest.approx((expected.low, expected.high), abs=1e-9)


def test_the_reference_mean_matrix_survives_saving_and_merging():
    ref = LengthReference(3)
    ref.update_matrix([[1.0, 0.2], [0.2, 1.0]])
    ref.update_matrix([[1.0, 0.4], [0.4, float("nan")]])
    assert ref.mean_matrix()[0, 1] == pytest.approx(0.3) and ref.mean_matrix()[1, 1] == 1.0
    again = LengthReference.from_dict(ref.to_dict())
    assert (again.mean_matrix() == ref.mean_matrix()).all()
    merged = ref.merge(again)
    assert merged.matrix_n[0, 1] == 4 and merged.mean_matrix()[0, 1] == pytest.approx(0.3)
    old = ref.to_dict()
    del old["matrix"]  # a state saved before the triage page
    assert LengthReference.from_dict(old).mean_matrix() is None
    detector = Detector(DetectorConfig())
    detector.merge_state({"version": 3, "references": [{"key": ["m", "r", 0], "reference": old}], "decisions": []})
    assert detector.references[("m", "r", 0)].mean_matrix() is None


def test_a_generation_models_prompt_mass_gets_its_own_panels_and_a_prefill_model_none():
    """Records of traces with decoding rows carry each head's prompt mass against its band:
    the page draws it beside the classic metrics, one panel per head; records without it
    (every other test here) draw no such panel."""
    recs = records()
    for r in recs:
        found = r.get("evidence")
        if found:
            heads = len(found["heads"])
            found["metrics"]["prompt_mass"] = [0.3] * heads
            found["band"]["prompt_mass"] = {"mean": [0.6] * heads, "sd": [0.05] * heads}
    incident = evidence.incidents(recs)[0]
    html = page.render(evidence.for_incident(recs, incident["incident_id"]))
    panels = set(re.findall(r'<g id="timeline-(head-\d)-prompt_mass"', html))
    assert panels and panels >= COLLAPSED_HEADS and "prompt mass (decoding rows)" in html
    plain = page.render(evidence.for_incident(records(), incident["incident_id"]))
    assert "prompt_mass" not in plain


def test_the_index_the_page_and_the_text_name_the_heads_of_the_incidents_record(collapsed):
    """One account of the heads: the incident record's, as the tracker keeps it and the
    alert shows it (``attention_incident_heads``); the index, the page and the text show
    it, with the traces naming each, and never count the records read again."""
    from monitor.triage.text import report

    recs, incident, case = collapsed
    heads, counts = incident["heads"], incident["head_counts"]
    assert set(heads) == COLLAPSED_HEADS and case.involved == heads and case.head_counts == counts
    listed = ", ".join(f"{h} ({counts[h]})" for h in heads)
    _, index = site.respond(recs, "", "")
    row = index[index.index(page.incident_href(incident["incident_id"])):].split("</tr>")[0]
    assert f'<td class="num">{incident["anomalies"]}</td>' in row
    assert listed in " ".join(re.sub(r"<[^>]+>", " ", row).split()).replace(" ,", ",")
    html = page.render(case)
    cells = parse(html)
    assert int(cells.cells[(None, "anomalies")]) == incident["anomalies"] and cells.heads == heads
    assert all(f'data-count="{h}"> {counts[h]}<' in html for h in heads)
    assert int(cells.cells[(None, "evidence_traces")]) == incident["traces"]
    text = report(case.records, [case])
    assert f"{incident['anomalies']} findings on {incident['traces']} traces" in text
    assert f"heads involved: {listed} (traces whose findings name each, of {incident['traces']})" in text


def test_the_strongest_findings_show_which_of_their_heads_the_incident_names(collapsed):
    *_, case = collapsed
    html = page.render(case)
    table = html[html.index('<table id="evidence">'):]
    table = table[:table.index("</table>")]
    named = re.findall(r'<span class="named">(head-\d+)</span>', table)
    assert named and set(named) <= set(case.involved)
    for r in case.strongest:  # every head a strong finding names is shown, the incident's in bold
        assert all(f">{h}</span>" in table for h in r["heads"])


@pytest.mark.parametrize("span", [0.0, 3.0, 90.0, 150.0, 2_400.0, 5 * 3600.0, 4 * 86_400.0])
def test_timelines_of_any_span_draw_without_a_library_warning(span):
    """matplotlib's date locator warns, on spans such as 2.5 minutes, that it could not
    pick an interval; `triage --html` printed that warning. Every span draws quietly."""
    import warnings

    from monitor.triage import charts
    from monitor.triage.evidence import Point

    points = [Point(1_800_000_000.0 + span * i / 4, 0.5, 0.6, 0.05) for i in range(5)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        svg = charts.timelines({"entropy": {"head-1": points, "head-2": points}})
    assert 'id="timeline-head-1-entropy"' in svg


def test_what_records_and_addresses_carry_is_escaped_on_every_page():
    """A model id, a revision or an address is text on the page, never markup."""
    html = page.render(evidence.for_layer(records(), "<i>lm</i>", "<b>r</b>", 0))
    assert "<i>lm</i>" not in html and "&lt;i&gt;lm&lt;/i&gt;" in html and "<b>r</b>" not in html
    _, notice = site.respond([], "layer", "model=%3Cb%3Ex&revision=r")
    assert "<b>x" not in notice and "model=&lt;b&gt;x" in notice
