"""The embedded demo: the monitor's own pipeline fed in-process, no Kafka needed.

Two revisions of a model serve realistic traffic (:mod:`monitor.tools.scenario`: mostly
short requests, healthy sinks and previous-token heads). Revision 2 is pinned to
revision 1's reference (as an operator would at deploy), and from its 40th request on,
four heads of one layer drift towards a single shared pattern: low head diversity.
Outcomes arrive before or after their traces; some never arrive (``pending`` after the
join's TTL: one could still come late); requests through the drifting layer fail more
often.
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from monitor.core.detect import DetectorConfig
from monitor.core.policy import NOT_PRUNING, SPECIALIZATION
from monitor.measuring.measurer import MeasurerSpec
from monitor.measuring.workers import Measuring
from monitor.protocol.access import Keyring, ScopePolicy
from monitor.protocol.codec import Limits, encode
from monitor.protocol.model_contract import ContractTable
from monitor.protocol.records import Output, Record
from monitor.protocol.topics import Topics
from monitor.service.exporter import MonitorMetrics
from monitor.service.pipeline import Loopback, Pipeline
from monitor.tools.scenario import Fault, Scenario

KEY_ID, SECRET = "demo", b"demo-secret-not-for-production"
COLLAPSING_LAYER = 2


@dataclass
class DemoResult:
    anomalies: list[dict[str, Any]] = field(default_factory=list)
    incidents: list[dict[str, Any]] = field(default_factory=list)
    dead_letters: list[dict[str, Any]] = field(default_factory=list)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_demo(registry: CollectorRegistry, *, requests: int = 240, pace: float = 0.0, seed: int = 7,
             reference_traces: int = 120) -> DemoResult:
    """Feed both revisions through a fresh pipeline; ``pace`` seconds between requests."""
    rng = np.random.default_rng(seed)
    rev1 = Scenario("demo-lm", "rev-2026-10-01")
    rev2 = Scenario("demo-lm", "rev-2026-11-15")
    contracts = ContractTable()
    for model in (rev1, rev2):
        contracts.add(model.contract())
    clock = _Clock()
    metrics = MonitorMetrics(registry, detail_level="head")
    detector = DetectorConfig(reference_traces=reference_traces, pins={(rev2.model_id, rev2.revision): rev1.revision})
    measuring = Measuring(MeasurerSpec(Keyring({KEY_ID: SECRET}), ScopePolicy.parse(["demo:*"]), Limits(),
                                       detector, dedupe_window=100_000), processes=0)
    measuring.sync_contracts(contracts)
    topics = Topics()
    pipeline = Pipeline(measuring, metrics=metrics, topics=topics, join_ttl=30.0, clock=clock)
    try:
        return _serve_requests(pipeline, rng, clock, (rev1, rev2), requests, pace)
    finally:
        pipeline.close()
        measuring.close()


def _serve_requests(pipeline: Pipeline, rng: np.random.Generator, clock: _Clock, models: tuple[Scenario, ...],
                    requests: int, pace: float) -> DemoResult:
    metrics, topics = pipeline.metrics, pipeline.topics
    rev1, rev2 = models
    result = DemoResult()
    hop = Loopback(topics)  # the observations topic, in-process: each stream's judge is this pipeline
    offset = 0
    for model, count in ((rev1, requests), (rev2, requests)):
        for layer in range(model.layers):
            metrics.layer(model.model_id, model.revision, layer)  # every series at zero from the start
        for i in range(count):
            collapse = min(0.9, max(0.0, (i - 40) / 60)) if model is rev2 else 0.0
            serving = replace(model, faults=(Fault("collapse", COLLAPSING_LAYER, (1, 2, 3, 4), collapse),)) \
                if collapse else model
            request_id = f"{model.revision}-req-{i:04d}"
            records: list[Record] = []
            for header, weights in serving.request(rng, request_id, timestamp=time.time()):
                records.append(Record(topics.traces, 0, offset, request_id.encode(),
                                      encode(header, weights, KEY_ID, SECRET)))
                offset += 1
            outcome = _outcome(rng, request_id, collapse, topics, offset)
            offset += 1
            if outcome is not None and rng.random() < 0.3:
                records.insert(0, outcome)  # the task system was quicker than the model server
            elif outcome is not None:
                records.append(outcome)
            if i % 50 == 25:  # a producer bug: a record signed with an unknown key
                header, weights = serving.request(rng)[0]
                records.append(Record(topics.traces, 0, offset, b"bad", encode(header, weights, "unknown-key",
                                                                               b"0" * 32)))
                offset += 1
            _collect(result, hop.run(pipeline, records))
            clock.now += 0.1
            if pace:
                time.sleep(pace)
    clock.now += 3600  # the end of the run: whatever still waits has no outcome
    _collect(result, hop.run(pipeline, []))
    return result


def _outcome(rng: np.random.Generator, request_id: str, collapse: float, topics: Topics, offset: int) -> Record | None:
    if rng.random() < 0.05:
        return None  # never reported
    failed = rng.random() < 0.08 + 0.35 * collapse
    doc = {"request_id": request_id, "outcome": "failure" if failed else "success", "timestamp": time.time()}
    return Record(topics.outcomes, 0, offset, request_id.encode(), json.dumps(doc).encode())


def _collect(result: DemoResult, outputs: list[Output]) -> None:
    for out in outputs:
        doc = json.loads(out.value)
        schema = doc.get("schema", "")
        if schema.startswith("attention-anomaly"):
            result.anomalies.append(doc)
        elif schema.startswith("attention-incident"):
            result.incidents.append(doc)
        else:
            result.dead_letters.append(doc)


def layer_means(registry: CollectorRegistry) -> dict[tuple[str, str], dict[str, float]]:
    """Per (revision, layer) trace counts and mean metrics, read back from the exported histograms."""
    table: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for family in registry.collect():
        name = family.name.removeprefix("attention_layer_")
        if not family.name.startswith("attention_layer_") or name == "effective_heads":
            continue
        sums = {(s.labels["revision"], s.labels["layer"]): s.value for s in family.samples if s.name.endswith("_sum")}
        for sample in family.samples:
            key = (sample.labels["revision"], sample.labels["layer"])
            if sample.name.endswith("_count") and sample.value:
                table[key][name] = sums.get(key, 0.0) / sample.value
                table[key]["traces"] = sample.value
    return table


def summary(result: DemoResult, registry: CollectorRegistry) -> str:
    lines = ["", "Per-layer metrics (means over traces, from /metrics)", "",
             f"{'revision':<16} {'layer':>5} {'traces':>6} {'diversity':>9} {'entropy':>8} {'concentr.':>9} "
             f"{'sink':>6}"]
    for (revision, layer), m in sorted(layer_means(registry).items()):
        lines.append(f"{revision:<16} {layer:>5} {m.get('traces', 0):>6.0f} {m.get('diversity', np.nan):>9.3f} "
                     f"{m.get('entropy', np.nan):>8.3f} {m.get('concentration', np.nan):>9.3f} "
                     f"{m.get('sink_share', np.nan):>6.3f}")
    closed = {i["incident_id"]: i for i in result.incidents if i["change"] == "closed"}
    opened = [i for i in result.incidents if i["change"] == "opened"]
    lines += ["", f"Incidents (what on-call is paged for): {len(opened)}"]
    for i in opened:
        final = closed.get(i["incident_id"], i)
        others = ", ".join(str(a["layer"]) for a in final.get("also_changed", []))
        lines.append(f"  {i['model_revision']} layer {i['layer']} {i['family']:<9} {final['anomalies']:>4} findings "
                     f"on {final['traces']} traces, heads {','.join(final['heads']) or '-'}; side effects "
                     + (", ".join(f"{k}={v}" for k, v in sorted(final["side_effects"].items())) or "none")
                     + (f"; layers {others} changed too" if others else ""))
    by_kind = Counter((a["model_revision"], a["layer"], a["kind"]) for a in result.anomalies)
    lines += ["", f"Anomalies raised (the incidents' evidence): {len(result.anomalies)}"]
    for (revision, layer, kind), n in sorted(by_kind.items()):
        outcomes = Counter(a["outcome"] for a in result.anomalies
                           if (a["model_revision"], a["layer"], a["kind"]) == (revision, layer, kind))
        lines.append(f"  {revision} layer {layer} {kind:<20} {n:>4}  outcomes: "
                     + ", ".join(f"{k}={v}" for k, v in sorted(outcomes.items())))
    low = [a for a in result.anomalies if a["kind"] == "low_diversity"]
    if low:
        a = max(low, key=lambda a: a["effect_size"])
        lines += ["", "Strongest low-diversity record (as published on attention-anomalies, no weights):",
                  f"  trace {a['trace_id']} request {a['request_id']} model {a['model_id']} {a['model_revision']}",
                  f"  contract {a['contract_id']}",
                  f"  layer {a['layer']} heads {','.join(a['heads'])} diversity {a['value']:.3f} vs reference "
                  f"{a['reference']:.3f} ({a['reference_revision']}), effect {a['effect_size']:.1f} sd, "
                  f"score {a['score']:.1f}, outcome {a['outcome']}"]
    reasons = Counter(d["reason"] for d in result.dead_letters)
    lines += ["", "Rejected records (dead-lettered without weights): "
              + (", ".join(f"{k}={v}" for k, v in sorted(reasons.items())) or "none"),
              "", "Policy:", f"  {SPECIALIZATION}", f"  {NOT_PRUNING}", ""]
    return "\n".join(lines)
