"""The /metrics page, byte for byte, for a fixed set of records (no broker needed): a
renamed metric, a changed label or bucket, or a series appearing or vanishing shows up
here first. Regenerate after an intended change with
``UPDATE_GOLDEN=1 pytest tests/test_exposition.py`` and review the diff.

Only the processing-time histogram depends on the machine; its sample values are masked,
and values are compared to 9 significant digits.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from monitor.codec import Limits
from monitor.core.detect import DetectorConfig
from monitor.exporter import MonitorMetrics
from monitor.measure import MeasurerSpec
from monitor.measuring import MeasuringThread
from monitor.model_contract import ContractTable
from monitor.pipeline import Pipeline
from monitor.records import Record
from monitor.topics import Topics
from tests.factories import CONTRACT, KEYRING, SCOPES, make_record

GOLDEN = Path(__file__).parent / "data" / "exposition.golden.txt"
TOPICS = Topics()


@pytest.fixture
def no_created_series():
    prometheus_client.disable_created_metrics()  # as the command line does
    yield
    prometheus_client.enable_created_metrics()


def exposition(detail_level: str) -> str:
    contracts = ContractTable()
    contracts.add(CONTRACT)
    measuring = MeasuringThread(MeasurerSpec(KEYRING, SCOPES, Limits(), DetectorConfig(reference_traces=4,
                                             min_effect=0.5, false_alarm_arl=2), dedupe_window=100))
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
        pipeline.process(healthy).result()
        pipeline.process(collapsed + odd).result()
        now["t"] += 60
        pipeline.process([]).result()  # the rest leave without an outcome
    finally:
        pipeline.close()
        measuring.close()
    text = generate_latest(registry).decode()
    text = re.sub(r"^(attention_monitor_processing_seconds_(?:bucket|sum|count)\{?[^ ]*) .*$", r"\1 <masked>", text,
                  flags=re.M)
    # sums of float metrics to 9 significant digits: BLAS builds may differ in the last bits
    return re.sub(r"^([a-z_]+(?:\{[^}]*\})?) (-?[0-9.e+-]+)$", lambda m: f"{m[1]} {float(m[2]):.9g}", text, flags=re.M)


def test_the_exposition_matches_the_golden_file(no_created_series):
    pages = "".join(f"# --- detail_level={level}\n{exposition(level)}" for level in ("layer", "head"))
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(pages)
    assert pages == GOLDEN.read_text(), "the /metrics page changed; see the module docstring"
