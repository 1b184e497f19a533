"""Prompt rows and decoding rows told apart on the triage page and in the text: an
upstream layer whose rows of generated tokens alone changed is not where the fault starts."""

from __future__ import annotations

import pytest

from monitor.core.incidents import IncidentTracker
from monitor.core.verdict import Anomaly
from monitor.protocol.findings import anomaly_record, incident_record, measured_on
from monitor.protocol.records import TraceIdentity
from monitor.triage import evidence, page
from monitor.triage.text import report
from tests.triage.test_page import parse


def incident_with_upstream(upstream_kind: str, rows: tuple[int, int] = (8, 4)) -> list[dict]:
    """Layer 1 of the canary pages (sink shift, on its prompt rows); layer 0 changes too,
    with ``upstream_kind`` findings."""
    tracker = IncidentTracker(quiet=600)
    out: list[dict] = []
    for n in range(6):
        at = 1000.0 + n
        for layer, kind in ((1, "sink_shift"), (0, upstream_kind)):
            ident = TraceIdentity(f"req-{n}/{layer}", f"req-{n}", "m", "canary", "c", layer, 12, at,
                                  ("attention-traces", 0, n), rows)
            found = [Anomaly(kind, layer, ("h3",), 0.9, 0.1, 9.0, 30.0, "healthy", pages=layer == 1)]
            docs = [anomaly_record(ident.fields(), a, "failure", at) for a in found]
            out += docs
            out += [incident_record(c.incident.summary(), c.what, at)
                    for c in tracker.observe("m", "canary", layer, found, docs, at, at)]
    return out


def test_an_upstream_layer_whose_decoding_rows_alone_changed_is_no_sign_the_fault_starts_there():
    recs = incident_with_upstream("prompt_mass_shift")
    case = evidence.incident_cases(recs)[0]
    assert case.incident["layer"] == 1 and case.incident["also_changed"][0]["relation"] == "upstream"
    assert (case.rows[0].prompt, case.rows[0].decoding) == (0, 6) and case.rows[1].prompt == 6
    html = page.render(case)
    cells = parse(html).cells
    assert "no sign that the fault starts here" in html and "look at it first" not in html
    assert "a fault in any layer moves them in every layer" in html
    text = report(case.records, [case], recs)
    assert "0 on prompt rows, 6 on rows of generated tokens: only its rows of generated tokens changed" in text
    assert (cells[(None, "prompt")], cells[(None, "decoding")]) == ("0", "6")  # the last row: layer 0


def test_an_upstream_layer_whose_prompt_rows_changed_is_where_to_look_first():
    recs = incident_with_upstream("entropy_collapse")
    case = evidence.incident_cases(recs)[0]
    assert (case.rows[0].prompt, case.rows[0].decoding) == (6, 0)
    html = page.render(case)
    assert "the fault may start here; look at it first" in html
    assert "look at it first" in report(case.records, [case], recs)


def test_records_that_do_not_say_their_rows_keep_the_advice_qualified():
    recs = incident_with_upstream("entropy_collapse", rows=(0, 0))
    assert all(r.get("measured_on") is None for r in recs if r.get("schema") == "attention-anomaly/1")
    case = evidence.incident_cases(recs)[0]
    assert "the records do not say which rows changed" in page.render(case)


@pytest.mark.parametrize(("rows", "kind", "said"), [
    ({"prompt": 8, "decoding": 4}, "entropy_collapse", "prompt"),  # classic metrics: the prompt rows
    ({"prompt": 8, "decoding": 4}, "prompt_mass_shift", "decoding"),
    ({"prompt": 8, "decoding": 4}, "learned_sink_shift", "decoding"),  # every row, generated tokens among them
    ({"prompt": 8, "decoding": 0}, "learned_sink_shift", "prompt"),
    ({"prompt": 0, "decoding": 5}, "low_diversity", "decoding"),  # a trace of decoding rows only
    ({"prompt": 0, "decoding": 0}, "low_diversity", None),
    (None, "low_diversity", None),
])
def test_which_rows_a_finding_was_measured_on(rows, kind, said):
    assert measured_on(rows, kind) == said


def test_a_traces_rows_travel_from_its_header_to_its_judge():
    """The measurer counts a trace's prompt and decoding rows from its header, and the
    observations record carries them to the judge (older records: not known)."""
    from types import SimpleNamespace

    import numpy as np

    from monitor.core.metrics import HeadMetrics
    from monitor.core.outcome import Outcome
    from monitor.measuring.measurer import trace_identity
    from monitor.protocol import observations
    from monitor.protocol.observations import Forwarded
    from monitor.protocol.records import Record
    from tests.factories import make_trace

    header, _ = make_trace(0, keys=32, rows=4)
    positions = sorted(header.query_positions)
    generation = header.model_copy(update={"prompt_length": positions[2] + 1})
    record = Record("attention-traces", 2, 7, None, None)
    assert trace_identity(SimpleNamespace(header=generation), record).rows == (3, 1)
    assert trace_identity(SimpleNamespace(header=header), record).rows == (4, 0)
    identity = trace_identity(SimpleNamespace(header=generation), record)
    h = len(header.heads)
    metrics = HeadMetrics(entropy=np.zeros(h), concentration=np.zeros(h), sink_share=np.zeros(h),
                          similarity=np.eye(h), diversity=np.array(1.0), effective_heads=np.array(float(h)),
                          prompt_mass=np.zeros(h), learned_sink=np.full(h, np.nan))
    value = observations.encode([Forwarded(identity, tuple(header.heads), metrics, Outcome("success"))])
    assert observations.decode(value)[0].identity.rows == (3, 1)
