"""Accounting of every record a fault test produced, from the monitors' own counters and
the committed outputs."""

from __future__ import annotations

from collections import Counter
from typing import Any


def processed(metrics: dict[str, float]) -> float:
    """Trace records one monitor process accounted for: measured, refused or duplicate."""
    measured = sum(v for k, v in metrics.items() if k.startswith("attention_traces_total{"))
    refused = sum(v for k, v in metrics.items() if k.startswith("attention_monitor_traces_rejected_total{"))
    return measured + refused + metrics.get("attention_monitor_duplicates_total", 0.0)


def one_output_each(records: list[dict[str, Any]], trace_ids: set[str], kind: str = "low_diversity") -> None:
    """Every expected trace id has exactly one anomaly record of ``kind``, no other has one."""
    counts = Counter(r["trace_id"] for r in records if r.get("kind") == kind)
    assert set(counts) == trace_ids, {"missing": sorted(trace_ids - set(counts))[:5],
                                      "unexpected": sorted(set(counts) - trace_ids)[:5]}
    assert set(counts.values()) == {1}, {t: n for t, n in counts.items() if n != 1}


def one_dead_letter_each(records: list[dict[str, Any]], sources: int) -> None:
    per_source = Counter((d["source"]["topic"], d["source"]["partition"], d["source"]["offset"]) for d in records)
    assert len(per_source) == sources and set(per_source.values()) == {1}, per_source.most_common(3)
