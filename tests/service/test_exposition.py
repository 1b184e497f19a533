"""The /metrics page, byte for byte, for a fixed set of records (no broker needed): a
renamed metric, a changed label or bucket, or a series appearing or vanishing shows up
here first. Regenerate after an intended change with
``UPDATE_GOLDEN=1 pytest tests/service/test_exposition.py`` and review the diff.

Only the processing-time histogram depends on the machine; its sample values are masked.
Other values come from float32 arithmetic, whose last bits depend on the CPU's vector
instructions (3.58784605 on one machine, 3.58784611 on another): they are written to 9
significant digits and compared within a relative 1e-6, everything else byte for byte.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from monitor.core.detect import DetectorConfig
from monitor.measuring.measurer import MeasurerSpec
from monitor.measuring.workers import Measuring
from monitor.protocol.codec import Limits
from monitor.protocol.model_contract import ContractTable
from monitor.protocol.records import Record
from monitor.protocol.topics import Topics
from monitor.service.exporter import MonitorMetrics
from monitor.service.pipeline import Loopback, Pipeline
from tests.factories import CONTRACT, KEYRING, SCOPES, make_record

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "exposition.golden.txt"
TOPICS = Topics()


@pytest.fixture
def no_created_series():
    prometheus_client.disable_created_metrics()  # as the command line does
    yield
    prometheus_client.enable_created_metrics()


def exposition(detail_level: str) -> str:
    contracts = ContractTable()
    contracts.add(CONTRACT)
    # a detector that finds and pages on the few traces here (no threshold worth the name)
    detector = DetectorConfig(reference_traces=4, min_effect=0.5, false_alarm_arl=2, false_pages_per_week=1e12)
    measuring = Measuring(MeasurerSpec(KEYRING, SCOPES, Limits(), detector, dedupe_window=100), processes=0)
    measuring.sync_contracts(contracts)
    registry = CollectorRegistry()
    now = {"t": 100.0}
    pipeline = Pipeline(measuring, metrics=MonitorMetrics(registry, detail_level=detail_level), topics=TOPICS,
                        join_ttl=5, clock=lambda: now["t"], wall_clock=lambda: 1_700_000_000.0)
    try:
        healthy = [Record(TOPICS.traces, 0, i, b"k", make_record(i, layer=i % 2)) for i in range(10)]
        collapsed = [Record(TOPICS.traces, 0, 10 + i, b"k", make_record(100 + i, collapse=0.95,
                                                                         request_id=f"collapsed-{i}"))
                     for i in range(3)]
        outcome = json.dumps({"request_id": "collapsed-1", "outcome": "failure"}).encode()
        odd = [Record(TOPICS.traces, 1, 0, b"k", b"not a trace"), healthy[0],
               Record(TOPICS.outcomes, 0, 0, b"r", outcome), Record(TOPICS.outcomes, 0, 1, b"r", b"{}")]
        hop = Loopback(TOPICS)  # each trace reaches its judge through the observations topic, in-process
        hop.run(pipeline, healthy)
        hop.run(pipeline, collapsed + odd)
        now["t"] += 60
        hop.run(pipeline, [])  # the rest leave without an outcome
    finally:
        pipeline.close()
        measuring.close()
    text = generate_latest(registry).decode()
    text = re.sub(r"^(attention_monitor_processing_seconds_(?:bucket|sum|count)\{?[^ ]*) .*$", r"\1 <masked>", text,
                  flags=re.M)
    return SAMPLE.sub(lambda m: f"{m[1]} {float(m[2]):.9g}", text)


#: a sample line: the series (name and labels), then its value
SAMPLE = re.compile(r"^([a-z_]+(?:\{[^}]*\})?) (-?[0-9.e+-]+|[+-]?Inf|NaN)$", re.M)


def differences(page: str, golden: str) -> list[str]:
    """Lines that differ: other than in a sample value within a relative 1e-6."""
    lines, expected = page.splitlines(), golden.splitlines()
    if len(lines) != len(expected):
        return [f"{len(lines)} lines, the golden file has {len(expected)}"]
    found = []
    for line, want in zip(lines, expected, strict=True):
        got, wanted = SAMPLE.match(line), SAMPLE.match(want)
        if got and wanted and got[1] == wanted[1] and math.isclose(float(got[2]), float(wanted[2]), rel_tol=1e-6):
            continue
        if line != want:
            found.append(f"{line!r}, golden {want!r}")
    return found


def test_the_exposition_matches_the_golden_file(no_created_series):
    pages = "".join(f"# --- detail_level={level}\n{exposition(level)}" for level in ("layer", "head"))
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(pages)
    found = differences(pages, GOLDEN.read_text())
    assert not found, f"the /metrics page changed (see the module docstring): {found[:5]}"


def test_the_comparison_allows_float32_rounding_and_nothing_else():
    golden = '# HELP x_total Things.\nx_total{a="1"} 3.58784605\ny 1\n'
    assert not differences(golden.replace("3.58784605", "3.58784611"), golden)
    assert differences(golden.replace("3.58784605", "3.5879"), golden)  # a value that moved
    assert differences(golden.replace('a="1"', 'a="2"'), golden)  # a label
    assert differences(golden.replace("Things", "Stuff"), golden)  # the help text
    assert differences(golden + "z 0\n", golden)  # a series appearing
