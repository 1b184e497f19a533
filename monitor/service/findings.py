"""The one verdict path: what a judge's verdict on a trace turns into.

Every verdict goes through :meth:`Findings.judged`, whichever way its trace came: judged
fresh, judged again after a restart whose records were written before it
(:attr:`Mode.WRITTEN`), or judged again when an observations partition moved here, to
rebuild its judges' evidence (:attr:`Mode.REPLAYED`). It makes the exporter's updates
(readiness, judging revision, anomaly counts, the layer's outcome tally), the anomaly
records (``monitor.protocol.findings``) and the incidents, with their records and
gauges. A new verdict metric is one edit here. An anomaly record carries the outcome
its trace was joined to where it was measured: a trace reaches its judge joined, or
``pending`` when its join window closed without one.

An outcome that comes later (:mod:`monitor.service.late`) reaches the same judge after
the request's traces, through :meth:`Findings.late`: the layers' tallies move it from
``pending``, ``attention_anomaly_outcomes`` counts it for the findings this judge
remembers of the request (at most ``OUTCOME_MAX_REQUESTS`` traces' kinds), and it is
written as its own ``attention-outcome/1`` record with the tallies after it.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from enum import Enum
from typing import Any

from monitor.core.detect import Verdict
from monitor.core.incidents import HANDED_OVER, Change, IncidentTracker
from monitor.core.outcome import PENDING, Outcome
from monitor.measuring.measurer import Duplicate, Rejected
from monitor.protocol.findings import anomaly_record, evidence_fields, incident_record, outcome_record
from monitor.protocol.observations import LateOutcome
from monitor.protocol.records import NO_SOURCE, Output, Source, TraceIdentity
from monitor.protocol.topics import Topics
from monitor.service.exporter import MonitorMetrics

__all__ = ["Findings", "Mode"]

log = logging.getLogger(__name__)


class Mode(Enum):
    FRESH = "fresh"  #: the exporter, the records and the incidents
    WRITTEN = "written"  #: the exporter and the incidents: its records were written before a restart
    REPLAYED = "replayed"  #: the incidents only, silently: rebuilding a moved partition's evidence


class Findings:
    """Verdicts in, exporter updates, anomaly and incident records and incidents out."""

    def __init__(self, metrics: MonitorMetrics, topics: Topics, incident_quiet: float,
                 clock: Callable[[], float], wall_clock: Callable[[], float], awaiting_max: int = 250_000):
        self.metrics, self.topics = metrics, topics
        self.incidents = IncidentTracker(incident_quiet)
        self._clock, self._wall = clock, wall_clock
        #: the kinds of the findings of traces judged ``pending``, by (request id, layer), for
        #: their late outcomes: at most ``awaiting_max``, the oldest forgotten first
        self.awaiting: OrderedDict[tuple[str, int], tuple[str, ...]] = OrderedDict()
        self._awaiting_max = awaiting_max

    def judged(self, identity: TraceIdentity, verdict: Verdict | Duplicate | Rejected, outcome: Outcome,
               source: Source, mode: Mode = Mode.FRESH) -> list[Output]:
        """The outputs of one verdict on a trace joined to ``outcome``, read from ``source``."""
        if isinstance(verdict, Duplicate):
            if mode is not Mode.REPLAYED:
                self.metrics.duplicates.inc()
            return []
        if isinstance(verdict, Rejected):
            if mode is not Mode.REPLAYED:
                self.metrics.rejected.labels(verdict.reason.value).inc()
            return []
        series = self.metrics.layer(identity.model_id, identity.model_revision, identity.layer)
        kinds = [a.kind for a in verdict.anomalies]
        if mode is not Mode.REPLAYED:
            series.observe_verdict(verdict)
            if verdict.evicted:
                self.metrics.references_evicted.inc(verdict.evicted)
            for kind in kinds:
                series.observe_anomaly(kind)
            self.metrics.judged_here.inc()
            series.observe_judged(outcome.result, kinds)
        if not verdict.anomalies:
            return []
        if outcome.result == PENDING.result:
            self._remember(identity.request_id, identity.layer, tuple(kinds))
        now = self._wall()
        if mode is Mode.REPLAYED:  # taken into the incidents silently: the first judge wrote its records
            docs = [anomaly_record(identity.fields(), a, outcome.result, now) for a in verdict.anomalies]
        else:
            evidence = evidence_fields(verdict.evidence)
            reference = self._reference_tally(identity.model_id, identity.model_revision, verdict.judged_by,
                                              identity.layer)
            docs = [anomaly_record(identity.fields(), a, outcome.result, now, evidence, series.outcomes,
                                   reference_outcomes=reference, outcome_label=outcome.label,
                                   outcome_score=outcome.score) for a in verdict.anomalies]
        changes = self.incidents.observe(identity.model_id, identity.model_revision, identity.layer,
                                         verdict.anomalies, docs, self._clock(), _opened_at(identity, now))
        if mode is Mode.REPLAYED:
            return []
        written = self.incident_records(changes, source)
        if mode is Mode.WRITTEN:
            return []
        return written + [Output(self.topics.anomalies, identity.request_id.encode(),
                                 json.dumps(doc, sort_keys=True).encode(), source) for doc in docs]

    def late(self, item: LateOutcome, judged_by: str, source: Source, mode: Mode = Mode.FRESH) -> list[Output]:
        """A request's outcome that came after its traces were judged ``pending`` (or
        ``missing``: its window closed): the tallies and ``attention_anomaly_outcomes`` of
        each of its layers, and (fresh, and given) its ``attention-outcome/1`` record."""
        if mode is Mode.REPLAYED:
            return []
        layers = []
        for layer in item.layers:
            kinds = self.awaiting.pop((item.request_id, layer), ())
            series = self.metrics.layer(item.model_id, item.revision, layer)
            series.observe_late(item.outcome.result, kinds)
            layers.append({"layer": layer, "kinds": sorted(set(kinds)), "layer_outcomes": dict(series.outcomes),
                           "reference_outcomes": self._reference_tally(item.model_id, item.revision, judged_by,
                                                                       layer)})
        if mode is Mode.WRITTEN or not item.outcome.known:
            return []
        doc = outcome_record(item.fields(), judged_by, layers, self._wall())
        return [Output(self.topics.anomalies, item.request_id.encode(), json.dumps(doc, sort_keys=True).encode(),
                       source)]

    def _remember(self, request_id: str, layer: int, kinds: tuple[str, ...]) -> None:
        self.awaiting[(request_id, layer)] = kinds
        self.awaiting.move_to_end((request_id, layer))
        while len(self.awaiting) > self._awaiting_max:
            self.awaiting.popitem(last=False)

    def _reference_tally(self, model: str, revision: str, judged_by: str | None, layer: int) -> dict[str, Any] | None:
        """The tally of the same layer of the revision whose reference judges ``revision``
        (None when it judges itself), with its name."""
        if judged_by is None or judged_by == revision:
            return None
        return {"revision": judged_by, **self.metrics.layer(model, judged_by, layer).outcomes}

    def expire(self) -> list[Output]:
        """Records of the incidents quiet for long enough to close."""
        return self.incident_records(self.incidents.expire(self._clock()), NO_SOURCE)

    def hand_over(self, judges: set[tuple[str, str]], judged_by: Callable[[str, str], str]) -> None:
        """The judge keys ``judges`` (model, judging revision) went to another instance
        with their partition, and the open incidents of the revisions they judge with
        them: here those incidents stay open until quiet (the gauge keeps the alert, its
        ``max`` over instances, from dipping while the new judge takes over), then
        close without a record (:meth:`IncidentTracker.hand_over`)."""
        self.incidents.hand_over(key for key in self.incidents.open if (key[0], judged_by(*key)) in judges)

    def restore(self, incidents: list[dict[str, Any]]) -> None:
        """Open incidents handed over with a moved partition (:meth:`IncidentTracker.restore`)."""
        self.incidents.restore(incidents, self._clock())

    def export_open(self) -> None:
        """Every open incident on its gauge (after a takeover: its alert neither resolves nor pages again)."""
        for incident in self.incidents.open.values():
            series = self.metrics.layer(*incident.key, incident.layer)
            series.incident_open[incident.family].set(1)
            series.incident_heads(incident.family, incident.named_counts())

    def incident_records(self, changes: list[Change], source: Source) -> list[Output]:
        """Incident records (opened, updated, closed) for the anomalies topic, and the
        gauges of the incident's primary layer."""
        out = []
        for change in changes:
            incident = change.incident
            model, revision = incident.key
            series = self.metrics.layer(model, revision, incident.layer)
            if change.what == "opened":
                series.incident_open[incident.family].set(1)
                series.incidents[incident.family].inc()
                log.warning("incident opened: %s (heads %s)", incident.id, ", ".join(incident.involved()) or "-")
            elif change.what == "closed":
                series.incident_open[incident.family].set(0)
                if change.reason == HANDED_OVER:
                    log.info("incident %s quiet here: its revision is judged by another instance since", incident.id)
                else:
                    log.info("incident closed: %s (%d findings)", incident.id, incident.anomalies)
            elif change.reason == "layers":
                layers = ", ".join(f"{a.layer} ({a.relation}{', paged' if a.paged else ''})"
                                   for _, a in sorted(incident.also_changed.items()))
                log.info("incident %s: other layers changed too: %s", incident.id, layers)
            elif change.reason == "heads":
                log.info("incident %s names heads %s", incident.id, ", ".join(incident.involved()))
            series.incident_heads(incident.family, {} if change.what == "closed" else incident.named_counts())
            if change.reason == HANDED_OVER:
                continue
            doc = incident_record(incident.summary(), change.what, self._wall())
            out.append(Output(self.topics.anomalies, incident.id.encode(), json.dumps(doc, sort_keys=True).encode(),
                              source))
        return out


def _opened_at(identity: TraceIdentity, now: float) -> float:
    """When an incident a trace opens was opened: the trace's own time (never later than
    now), so that a judge that takes the stream over and judges the trace again names the
    incident as the first judge did."""
    return min(identity.trace_timestamp, now) if identity.trace_timestamp > 0 else now
