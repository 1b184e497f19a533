"""``attention-monitor status`` as text: columns as wide as their longest value, whatever
the model ids and revisions; open incidents with the heads they name."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from monitor.cli import app
from monitor.service.exporter import MonitorMetrics
from monitor.service.http import MetricsServer
from monitor.tools.status import LayerStatus, Status, from_metrics, report

LONG_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
REVISION = "9c3f0a1b2c3d4e5f60718293a4b5c6d7e8f90123"


def columns(line: str, header: str) -> list[str]:
    """The cells of ``line`` cut where the header's columns start."""
    starts = [0, *(m.end() for m in re.finditer(r"  +", header))]
    return [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]


def test_every_column_fits_its_longest_value_and_rows_split_like_the_header():
    status = Status()
    status.layers[(LONG_MODEL, REVISION, 4)] = LayerStatus(REVISION, 200, True, 12_345, {}, ["diversity"],
                                                           {"diversity": {"head-2": 20, "head-7": 23}})
    status.layers[("m", "r1", 10)] = LayerStatus("-", 30, False, 30, {"learning": 30.0})
    lines = report(status, 200).splitlines()
    header, rows = lines[0], lines[1:3]
    expected = [["m", "r1", "10", "-", "30/200 learning", "30", "learning 30", "-"],
                [LONG_MODEL, REVISION, "4", REVISION, "200/200 ready", "12345", "-",
                 "diversity: head-7 (23), head-2 (20)"]]
    assert [columns(row, header) for row in rows] == expected
    assert all(len(row) <= len(max(lines[:3], key=len)) for row in rows)
    assert all(row.split()[:3] == cells[:3] for row, cells in zip(rows, expected, strict=True))


def test_open_incidents_show_the_heads_their_gauge_names():
    status = Status()
    from_metrics(status, "\n".join([
        'attention_incident_open{model="m",revision="r",layer="2",family="diversity"} 1',
        'attention_incident_heads{model="m",revision="r",layer="2",family="diversity",head="head-1"} 3',
        'attention_incident_heads{model="m",revision="r",layer="2",family="diversity",head="head-4"} 9',
        'attention_traces_total{model="m",revision="r",layer="2"} 40', ""]))
    row = status.layers[("m", "r", 2)]
    assert row.incidents == ["diversity"] and row.heads == {"diversity": {"head-1": 3.0, "head-4": 9.0}}
    assert report(status, 200).splitlines()[1].endswith("diversity: head-4 (9), head-1 (3)")


def test_a_layer_is_ready_when_the_instance_that_judges_it_says_so():
    """Every instance measures the layer, one judges it: the others export 0, whichever
    order the instances are scraped in."""
    judge = 'attention_reference_ready{model="m",revision="r",layer="0"} 1\n'
    other = 'attention_reference_ready{model="m",revision="r",layer="0"} 0\n'
    for order in ((judge, other), (other, judge), (other, other)):
        status = Status()
        for text in order:
            from_metrics(status, text)
        assert status.layers[("m", "r", 0)].ready is (judge in order)


def test_a_layer_another_instance_judges_is_not_shown_as_learning_from_one_instance_alone():
    """One instance's /metrics, of a layer it measures and another instance judges: its
    reference gauges read 0, which is no verdict, not a reference learning; with the
    judge's /metrics too the fleet's view shows the judge's."""
    measures = "\n".join([
        'attention_traces_total{model="m",revision="r",layer="0"} 40',
        'attention_reference_traces{model="m",revision="r",layer="0"} 0',
        'attention_reference_ready{model="m",revision="r",layer="0"} 0', ""])
    judges = "\n".join([
        'attention_traces_total{model="m",revision="r",layer="0"} 60',
        'attention_reference_traces{model="m",revision="r",layer="0"} 100',
        'attention_reference_ready{model="m",revision="r",layer="0"} 0',
        'attention_traces_unjudged_total{model="m",revision="r",layer="0",reason="learning"} 100', ""])
    alone = Status()
    from_metrics(alone, measures)
    text = report(alone, 200)
    header, row = text.splitlines()[:2]
    assert columns(row, header)[4] == "- (no verdict here)", text
    assert "another instance judges it (give every instance's /metrics, --url once each)" in text
    fleet = Status()
    for metrics in (measures, judges):
        from_metrics(fleet, metrics)
    text = report(fleet, 200)
    header, row = text.splitlines()[:2]
    assert columns(row, header)[4:6] == ["100/200 learning", "100"] and "no verdict" not in text, text


def test_an_idle_fleet_is_read_and_exits_0_and_a_url_may_leave_out_its_scheme(monkeypatch):
    """Instances that answer but have seen no layer yet are a healthy idle fleet, not
    "nothing can be read"; without STATE_DIR where the command runs, the note says that
    is where it runs, not that the instances save nothing."""
    monkeypatch.delenv("ATTENTION_MONITOR_STATE_DIR", raising=False)
    registry = CollectorRegistry()
    MonitorMetrics(registry)  # an instance's own series, before its first trace
    server = MetricsServer(registry, port=0).start()
    port = server.port
    try:
        result = CliRunner().invoke(app, ["status", "--url", f"127.0.0.1:{port}/metrics",
                                          "--url", f"{server.url}/metrics"])
        assert result.exit_code == 0, result.output
        assert "(no layer seen yet)" in result.output and "did not answer" not in result.output, result.output
        assert "STATE_DIR is not set where this command runs" in result.output
    finally:
        server.stop()
    result = CliRunner().invoke(app, ["status", "--url", f"127.0.0.1:{port}/metrics"])
    assert result.exit_code == 1 and "did not answer" in result.output, result.output
