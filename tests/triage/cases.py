"""Anomaly and incident records as the service writes them, made by the real detector
and incident tracker on the scenario traffic (healthy r1, then r2 with heads 1–4 of
layer 2 collapsed, judged by r1's reference)."""

from __future__ import annotations

from typing import Any

import numpy as np

from monitor.core.detect import Detector, DetectorConfig, Observation
from monitor.core.incidents import IncidentTracker
from monitor.core.metrics import head_metrics
from monitor.protocol.codec import valid_keys
from monitor.protocol.findings import anomaly_record, evidence_fields, incident_record
from monitor.service.exporter import MonitorMetrics
from monitor.tools.scenario import Fault, Scenario

HEALTHY = Scenario(revision="r1")
COLLAPSED = Scenario(revision="r2", faults=(Fault("collapse", 2, (1, 2, 3, 4)),))
COLLAPSED_HEADS = {"head-1", "head-2", "head-3", "head-4"}


def records(collapsed_requests: int = 20, seed: int = 0, failure_rate: float = 0.5,
            metrics: MonitorMetrics | None = None) -> list[dict[str, Any]]:
    """The records of 100 healthy requests then ``collapsed_requests`` collapsed ones;
    anomalous traces fail with ``failure_rate``, the others with 0.1. The collapse pages
    on about its 16th request: the page threshold of a 100-trace reference allows for its
    estimation error (twice that of an exact reference). Each trace, its verdict, its
    findings and its incidents are also reported to ``metrics`` as the service reports
    them (:mod:`monitor.service.pipeline`, :mod:`monitor.service.findings`)."""
    rng = np.random.default_rng(seed)
    detector = Detector(DetectorConfig(reference_traces=100, pins={("scenario-lm", "r2"): "r1"}))
    incidents = IncidentTracker(quiet=600)
    outcomes: dict[tuple[str, int], dict[str, int]] = {}
    out: list[dict[str, Any]] = []
    now = 1_800_000_000.0
    for n, scenario in enumerate([HEALTHY] * 100 + [COLLAPSED] * collapsed_requests):
        now += 1.0
        for header, weights in scenario.request(rng, request_id=f"req-{n}"):
            m = head_metrics(weights, valid_keys(header))
            verdict = detector.observe(Observation(header.model_id, header.model_revision, header.layer,
                                                   header.key_count, header.heads, m))
            series = None if metrics is None else metrics.layer(header.model_id, header.model_revision, header.layer)
            if series is not None:
                series.observe_trace(header.heads, m)
                series.observe_verdict(verdict)
                for a in verdict.anomalies:
                    series.observe_anomaly(a.kind)
            ident = {"trace_id": f"{header.request_id}/{header.layer}", "request_id": header.request_id,
                     "model_id": header.model_id, "model_revision": header.model_revision, "layer": header.layer,
                     "contract_id": "c-" + header.model_revision}
            failed = rng.random() < (failure_rate if verdict.anomalies else 0.1)
            outcome = "failure" if failed else "success"
            counts = outcomes.setdefault((header.model_revision, header.layer), {"success": 0, "failure": 0,
                                                                                 "missing": 0})
            counts[outcome] += 1
            evidence = evidence_fields(verdict.evidence)
            docs = [anomaly_record(ident, a, None, now, evidence) for a in verdict.anomalies]
            for change in incidents.observe(header.model_id, header.model_revision, header.layer,
                                            verdict.anomalies, docs, now, now):
                out.append(incident_record(change.incident.summary(), change.what, now))
                if metrics is not None and change.what in ("opened", "closed"):
                    opened = metrics.layer(*change.incident.key, change.incident.layer)
                    opened.incident_open[change.incident.family].set(1 if change.what == "opened" else 0)
            judged_by = "r1"  # r2 is pinned to r1: the anomaly records carry r1's counts of the layer too
            reference = None if header.model_revision == judged_by else {
                "revision": judged_by, **outcomes.get((judged_by, header.layer), {})}
            out += [anomaly_record(ident, a, outcome, now + 0.5, evidence, counts, reference_outcomes=reference)
                    for a in verdict.anomalies]
    return out
