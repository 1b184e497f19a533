"""The labelled children of one (model, revision, layer): every series of a layer,
looked up once, created at zero."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from monitor.core.detect import KINDS, Verdict
from monitor.core.incidents import FAMILIES
from monitor.core.metrics import HeadMetrics
from monitor.service.label_guard import OTHER
from monitor.service.metric_families import OUTCOMES, PENDING, MetricFamilies


class LayerSeries:
    """The labelled children of one (model, revision, layer), looked up once: observing
    a trace then costs no ``labels()`` call (prometheus_client hashes and locks on each).
    Every series of the layer exists from creation, at zero, so rates exist before the
    first event."""

    def __init__(self, metrics: MetricFamilies, labels: tuple[str, str], layer: int | str):
        self.labels = labels
        key = (*labels, str(layer))
        self.traces = metrics.traces.labels(*key)
        self.diversity = metrics.diversity.labels(*key)
        self.effective_heads = metrics.effective_heads.labels(*key)
        self.layer_metric = {name: family.labels(*key) for name, family in metrics.layer_metric.items()}
        self._generation: dict[str, Any] = {}  #: created by the first trace that has the metric
        self._head_families = metrics.head_metric
        self._key = key
        self._heads: dict[str, list[tuple[str, Any]]] = {}
        self.anomalies = {kind: metrics.anomalies.labels(*key, kind) for kind in KINDS}
        self.trace_outcomes = {outcome: metrics.trace_outcomes.labels(*key, outcome) for outcome in OUTCOMES}
        self.pending = metrics.trace_outcomes_pending.labels(*key)
        #: the layer's traces judged here by their outcome (``pending`` while it may still
        #: come), since start, as anomaly records carry them (the one tally: its judge
        #: judges all the fleet's traces); late outcomes move a trace from ``pending``
        self.outcomes = dict.fromkeys((*OUTCOMES, PENDING), 0)
        self.anomaly_outcomes = {(kind, outcome): metrics.anomaly_outcomes.labels(*key, kind, outcome)
                                 for kind in KINDS for outcome in OUTCOMES}
        self.reference_traces = metrics.reference_traces.labels(*key)
        self.reference_ready = metrics.reference_ready.labels(*key)
        self.unjudged = {reason: metrics.unjudged.labels(*key, reason) for reason in ("learning", "no_reference")}
        self.incident_open = {family: metrics.incident_open.labels(*key, family) for family in FAMILIES}
        self.incidents = {family: metrics.incidents.labels(*key, family) for family in FAMILIES}
        self._incident_heads: dict[str, set[str]] = {}
        self._metrics = metrics
        self._judge: str | None = None

    def observe_trace(self, heads: Sequence[str], metrics: HeadMetrics) -> None:
        entropy, concentration = metrics.entropy.tolist(), metrics.concentration.tolist()
        sink_share = metrics.sink_share.tolist()
        diversity, effective_heads = float(metrics.diversity), float(metrics.effective_heads)
        self.traces.inc()
        if diversity == diversity:  # NaN (a single head) is not observed
            self.diversity.observe(diversity)
        if effective_heads == effective_heads:
            self.effective_heads.observe(effective_heads)
        values = {"entropy": entropy, "concentration": concentration, "sink_share": sink_share}
        for name, per_head in values.items():
            finite = [v for v in per_head if v == v]
            if finite:
                self.layer_metric[name].observe(sum(finite) / len(finite))
        for name in ("prompt_mass", "learned_sink"):
            array = getattr(metrics, name)
            finite = [] if array is None else [v for v in array.tolist() if v == v]
            if finite:
                child = self._generation.get(name)
                if child is None:
                    child = self._generation[name] = self._metrics.generation_metric[name].labels(*self._key)
                child.observe(sum(finite) / len(finite))
        if self._head_families:
            for i, children in enumerate(self._head_children(heads)):
                for name, child in children:
                    value = values[name][i]
                    if value == value:
                        child.observe(value)

    def _head_children(self, heads: Sequence[str]) -> list[list[tuple[str, Any]]]:
        out = []
        for head in heads:
            children = self._heads.get(head)
            if children is None:
                children = self._heads[head] = [(name, family.labels(*self._key, head))
                                                for name, family in self._head_families.items()]
            out.append(children)
        return out

    def incident_heads(self, family: str, counts: dict[str, int]) -> None:
        """``attention_incident_heads`` of the layer's incident of ``family``: the heads
        it names and the traces naming each (none: it closed)."""
        gauge = self._metrics.incident_heads
        for head in self._incident_heads.get(family, set()) - counts.keys():
            gauge.remove(*self._key, family, head)
        for head, n in counts.items():
            gauge.labels(*self._key, family, head).set(n)
        self._incident_heads[family] = set(counts)

    def observe_anomaly(self, kind: str) -> None:
        self.anomalies[kind].inc()

    def observe_verdict(self, verdict: Verdict) -> None:
        """Readiness: how many traces the judging reference holds, whether it judges, by
        which revision; and the traces nothing judged."""
        self.reference_traces.set(verdict.reference_traces)
        self.reference_ready.set(1 if verdict.ready else 0)
        if verdict.judged_by is None:
            self.unjudged["learning" if verdict.learning else "no_reference"].inc()
            return
        judge = self._metrics.guard.labels(self.labels[0], verdict.judged_by)
        value = OTHER if judge is None else judge[1]
        if value != self._judge:
            if self._judge is not None:
                self._metrics.reference_judge.remove(*self._key, self._judge)
            self._metrics.reference_judge.labels(*self._key, value).set(1)
            self._judge = value

    def observe_joined(self, outcome: str) -> None:
        """A trace measured here joined to its outcome (``attention_trace_outcomes``)."""
        self.trace_outcomes[outcome].inc()

    def observe_judged(self, outcome: str, kinds: Iterable[str]) -> None:
        """A trace judged here, with the outcome it was joined to and its anomalies' kinds
        (the tally, and ``attention_anomaly_outcomes`` once the outcome is known)."""
        self.outcomes[outcome] += 1
        if outcome != PENDING:
            for kind in set(kinds):
                self.anomaly_outcomes[(kind, outcome)].inc()

    def observe_late(self, outcome: str, kinds: Iterable[str]) -> None:
        """A trace judged here ``pending`` got its outcome late (or ``missing``): the
        tally moves it, ``attention_anomaly_outcomes`` counts it for ``kinds``."""
        if self.outcomes[PENDING] > 0:  # judged before this judge started: not in its tally
            self.outcomes[PENDING] -= 1
        self.observe_judged(outcome, kinds)
