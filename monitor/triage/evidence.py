"""What a triage page shows, gathered from the records the monitor wrote: one incident,
or one (model, revision, layer) selection, with its anomaly records, the trace beside
its reference, the heads involved and what the outcomes say (``outcomes``). Pure data: the charts
and the HTML are made from a :class:`Case` elsewhere (``charts``, ``page``).

The heads of an incident are its record's :class:`~monitor.core.incidents.HeadAccount`,
as the incident tracker keeps it and its alert shows it, never counted again here (the
records read may be a part of its evidence). A selection without an incident counts its
findings with the same account."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from monitor.core.incidents import FAMILY, HeadAccount
from monitor.triage import generation, outcomes
from monitor.triage.generation import LayerRows
from monitor.triage.outcomes import Outcomes, Rate, wilson
from monitor.triage.seen import SeenLayer

__all__ = ["Case", "Point", "Rate", "account", "for_incident", "for_layer", "incident_cases", "wilson"]

#: anomaly records listed as the strongest evidence
STRONGEST = 10
#: head metrics the timelines show (the last two when the records carry them: a learned
#: sink, decoding rows)
TIMELINE_METRICS = ("entropy", "concentration", "sink_share", "learned_sink", "prompt_mass")
#: heads the timelines show at most: the involved ones, then those most often named by findings
TIMELINE_HEADS = 6


@dataclass(frozen=True)
class Point:
    """One anomalous trace's head metric beside the reference band at its length."""

    at: float
    value: float
    mean: float
    sd: float


@dataclass
class Case:
    """Everything one triage page says."""

    model: str | None
    revision: str | None
    layer: int | None
    incident: dict[str, Any] | None  #: the incident's latest record
    records: list[dict[str, Any]]  #: its anomaly records, oldest first
    involved: list[str] = field(default_factory=list)  #: the heads named, best supported first
    #: how many traces' findings name each head (every head the evidence names, most first)
    head_counts: dict[str, int] = field(default_factory=dict)
    evidence_traces: int = 0  #: the traces those counts are of
    latest: dict[str, Any] | None = None  #: the newest anomaly record that carries evidence
    outcomes: Outcomes | None = None  #: the revision against its reference, the anomalous traces against the rest
    #: every layer of the revision with findings (while the incident was open), by the rows they were measured on
    rows: dict[int, LayerRows] = field(default_factory=dict)
    #: the outcome records among the records read, by request id (outcomes that came late)
    late: dict[str, dict[str, Any]] = field(default_factory=dict)

    def outcome_of(self, record: dict[str, Any]) -> str:
        """An anomaly record's outcome, or its request's late one (said so)."""
        said = outcomes.resolved(record, self.late)
        return str(said["outcome"] or "pending") + (" (late)" if said["late"] else "")
    timelines: dict[str, dict[str, list[Point]]] = field(default_factory=dict)  #: metric → head → points
    #: the layer as this instance's metrics have it (None: not seen here, or no instance asked)
    seen: SeenLayer | None = None

    @property
    def healthy(self) -> bool:
        """Nothing to investigate: no incident and no anomaly record."""
        return self.incident is None and not self.records

    @property
    def incident_id(self) -> str:
        """The incident's id ('' for a selection without one)."""
        return str((self.incident or {}).get("incident_id", ""))

    @property
    def traces(self) -> int:
        """Distinct traces among the records."""
        return len({r["trace_id"] for r in self.records})

    @property
    def kinds(self) -> dict[str, int]:
        return dict(Counter(str(r["kind"]) for r in self.records))

    @property
    def evidence(self) -> list[dict[str, Any]]:
        """The records the heads are counted from: the incident's family (a diversity
        incident's records also hold its head-pattern side effects)."""
        family = (self.incident or {}).get("family")
        return [r for r in self.records if family is None or FAMILY.get(str(r.get("kind"))) == family]

    @property
    def strongest(self) -> list[dict[str, Any]]:
        """The evidence of the largest effects."""
        return sorted(self.evidence, key=lambda r: -float(r.get("effect_size", 0.0)))[:STRONGEST]

    @property
    def others_named(self) -> dict[str, int]:
        """Heads some findings name that the account does not (yet) name, with their counts."""
        return {h: n for h, n in self.head_counts.items() if h not in self.involved}

    @property
    def contract_ids(self) -> list[str]:
        """The contracts its records name; without records, those of the layer this
        instance knows (:attr:`seen`)."""
        found = sorted({str(r["contract_id"]) for r in self.records if r.get("contract_id")})
        return found or (list(self.seen.contract_ids) if self.seen else [])

    @property
    def reference_revisions(self) -> list[str]:
        """The revisions whose references judged its records; without records, the one
        that judges the layer on this instance now (:attr:`seen`)."""
        found = {str(r["reference_revision"]) for r in self.records if r.get("reference_revision")}
        if self.incident and self.incident.get("reference_revision"):
            found.add(str(self.incident["reference_revision"]))
        if not found and self.seen and self.seen.judged_by:
            found.add(self.seen.judged_by)
        return sorted(found)

    @property
    def identity_from_metrics(self) -> bool:
        """Its judge and contract come from this instance's metrics, not its records."""
        return not self.records and self.incident is None and self.seen is not None

    @property
    def title(self) -> str:
        if self.incident is not None:
            return f"Incident {self.incident['incident_id']}"
        layer = "*" if self.layer is None else self.layer
        return f"{self.model or 'any model'} {self.revision or ''} layer {layer}"


def incidents(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The latest record of every incident in ``records``, newest opened first."""
    latest: dict[str, dict[str, Any]] = {}
    for r in records:
        if str(r.get("schema", "")).startswith("attention-incident"):
            latest[r["incident_id"]] = r
    return sorted(latest.values(), key=lambda i: -float(i["opened_at"]))


def anomalies(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if str(r.get("schema", "")).startswith("attention-anomaly")]


def for_incident(records: list[dict[str, Any]], incident_id: str) -> Case | None:
    """The case of one incident (None when no record of it is in ``records``)."""
    found = [i for i in incidents(records) if i["incident_id"] == incident_id]
    return _case(records, found[0]) if found else None


def incident_cases(records: list[dict[str, Any]], model: str | None = None, revision: str | None = None,
                   layer: int | None = None) -> list[Case]:
    """The case of every incident matching the filters, newest opened first: the index,
    the pages and the text all count findings and name heads from these."""
    return [_case(records, i) for i in incidents(records)
            if (model is None or i["model_id"] == model) and (revision is None or i["model_revision"] == revision)
            and (layer is None or i["layer"] == layer)]


def for_layer(records: list[dict[str, Any]], model: str, revision: str, layer: int) -> Case:
    """The case of a (model, revision, layer): its newest incident when it has one, else
    its anomaly records, else a healthy case (nothing to investigate)."""
    mine = [i for i in incidents(records)
            if (i["model_id"], i["model_revision"], i["layer"]) == (model, revision, layer)]
    if mine:
        return _case(records, mine[0])
    chosen = [r for r in anomalies(records)
              if (r.get("model_id"), r.get("model_revision"), r.get("layer")) == (model, revision, layer)]
    return _from_every_record(_complete(Case(model, revision, layer, None, sorted(chosen, key=_detected))), records)


def _detected(record: dict[str, Any]) -> float:
    return float(record.get("detected_at", 0.0))


def _case(records: list[dict[str, Any]], incident: dict[str, Any]) -> Case:
    """An incident's anomaly records: its layer's, of its family (a diversity incident
    also shows the head findings that were its side effects), from its opening to its
    close."""
    key = (incident["model_id"], incident["model_revision"], incident["layer"])
    family = incident["family"]
    start = float(incident.get("evidence_since") or incident["opened_at"])
    end = float(incident["at"]) if incident.get("state") == "closed" else math.inf
    chosen = [r for r in anomalies(records)
              if (r.get("model_id"), r.get("model_revision"), r.get("layer")) == key
              and (family == "diversity" or FAMILY.get(str(r.get("kind"))) == family)
              and start - 1.0 <= _detected(r) <= end]
    case = Case(*key, incident, sorted(chosen, key=_detected))
    return _from_every_record(_complete(case), records)


def account(records: list[dict[str, Any]]) -> HeadAccount:
    """The heads account of anomaly records without an incident, counted as the incident
    tracker counts an incident's: trace by trace, in the order they were detected."""
    by_trace: dict[str, list[str]] = {}
    for r in sorted(records, key=_detected):
        by_trace.setdefault(str(r["trace_id"]), []).extend(r.get("heads", []))
    counted = HeadAccount()
    for heads in by_trace.values():
        counted.add(heads)
    return counted


def _complete(case: Case) -> Case:
    records = case.records
    if case.incident is not None:  # the incident's own account, as its record has it
        case.involved = [str(h) for h in case.incident.get("heads", [])]
        case.head_counts = {str(h): int(n) for h, n in (case.incident.get("head_counts") or {}).items()}
        case.evidence_traces = int(case.incident.get("traces", 0))
    else:
        counted = account(records)
        case.involved, case.head_counts, case.evidence_traces = counted.heads(), dict(counted.counts.most_common()), \
            counted.traces
    with_evidence = [r for r in records if r.get("evidence")]
    strongest = (case.incident or {}).get("strongest") or {}
    case.latest = with_evidence[-1] if with_evidence else (strongest if strongest.get("evidence") else None)
    named = Counter(h for r in records for h in r.get("heads", []))
    shown = [*case.involved, *(h for h, _ in named.most_common() if h not in case.involved)][:TIMELINE_HEADS]
    case.timelines = _timelines(with_evidence, shown)
    return case


def _from_every_record(case: Case, records: list[dict[str, Any]]) -> Case:
    """What the case takes from every record read: the outcomes of its traces and of its
    revision, with the late outcomes and newest tallies (:mod:`monitor.triage.outcomes`),
    and the rows its revision's findings on every layer were measured on while the
    incident was open (:mod:`monitor.triage.generation`)."""
    case.late = outcomes.late_outcomes(records)
    case.outcomes = outcomes.view(case.records, records, case.model, case.revision, case.layer)
    incident = case.incident or {}
    start = float(incident.get("evidence_since") or incident.get("opened_at") or math.inf) - 1.0
    end = float(incident["at"]) if incident.get("state") == "closed" else math.inf
    case.rows = generation.layer_rows(records, case.model, case.revision, start if incident else -math.inf, end)
    return case


def _timelines(records: list[dict[str, Any]], shown: list[str]) -> dict[str, dict[str, list[Point]]]:
    """Per metric and head shown, every anomalous trace's value beside its band (each
    trace once)."""
    out: dict[str, dict[str, list[Point]]] = {m: {} for m in TIMELINE_METRICS}
    seen: set[str] = set()
    for r in records:
        if r["trace_id"] in seen:
            continue
        seen.add(r["trace_id"])
        evidence = r["evidence"]
        heads = evidence["heads"]
        for metric in TIMELINE_METRICS:
            if metric not in evidence["metrics"] or metric not in evidence["band"]:
                continue
            values, band = evidence["metrics"][metric], evidence["band"][metric]
            for head in shown:
                if head not in heads:
                    continue
                i = heads.index(head)
                if values[i] is None or band["mean"][i] is None:
                    continue
                out[metric].setdefault(head, []).append(
                    Point(_detected(r), float(values[i]), float(band["mean"][i]), float(band["sd"][i] or 0.0)))
    return out
