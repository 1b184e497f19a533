"""Incidents: what on-call is paged for, one per fault of a model revision.

Findings (anomaly records) are evidence; most never page. An incident opens only on a
finding whose evidence crossed the *page* threshold (``Anomaly.pages``, calibrated to the
false-page budget: :mod:`monitor.core.detect`), and one fault gives one incident, whose
key is the (model, revision): the layer and family of that first paging finding are the
incident's *primary* and never change while it is open, so its alert keeps its labels.

A fault on one layer changes the layers after it too (through the residual stream), and
one layer's fault shows in several kinds of finding. While an incident is open, every
finding of the revision is counted in it: on the primary layer, findings of the primary
family are its evidence (heads named are those in the findings of at least
``HEAD_SHARE`` of its traces) and
the other kinds its side effects; on any other layer they are annotations
(``also_changed``: downstream after the primary layer, upstream before it), paging or
not. A finding of a layer's first annotation, or of an annotation's first page,
updates the incident record. The incident closes after ``quiet`` seconds without a
finding of its revision.

Families: ``diversity`` (``low_diversity``) and ``head`` (``entropy_collapse``,
``concentration_spike``, ``sink_shift``, ``learned_sink_shift``, ``prompt_mass_shift``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from monitor.core.detect import Anomaly

FAMILY = {"low_diversity": "diversity", "entropy_collapse": "head", "concentration_spike": "head",
          "sink_shift": "head", "learned_sink_shift": "head", "prompt_mass_shift": "head"}
FAMILIES = ("diversity", "head")
#: heads named by an incident: those in at least this share of its primary findings
HEAD_SHARE = 0.5
RevisionKey = tuple[str, str]  # model, revision


@dataclass
class Annotation:
    """Another layer of the revision that changed while the incident was open."""

    layer: int
    relation: str  #: "downstream" (after the primary layer) or "upstream" (before it)
    findings: int = 0
    paged: bool = False  #: its evidence crossed the page threshold too
    kinds: Counter[str] = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        return {"layer": self.layer, "relation": self.relation, "findings": self.findings, "paged": self.paged,
                "kinds": dict(self.kinds)}


@dataclass
class Incident:
    key: RevisionKey
    layer: int  #: the primary layer: the first whose evidence paged
    family: str  #: the primary family
    opened_at: float
    last_at: float
    opened_wall: float  #: seconds since the epoch, for records
    anomalies: int = 0  #: findings of the primary family on the primary layer
    traces: int = 0  #: traces of the primary layer with such a finding
    kinds: Counter[str] = field(default_factory=Counter)
    heads: Counter[str] = field(default_factory=Counter)  #: of those traces, how many named each head
    side_effects: Counter[str] = field(default_factory=Counter)  #: other kinds on the primary layer
    also_changed: dict[int, Annotation] = field(default_factory=dict)
    strongest: dict[str, Any] = field(default_factory=dict)  #: the primary finding of the largest effect
    reference_revision: str = ""
    closed_at: float | None = None

    @property
    def id(self) -> str:
        model, revision = self.key
        return f"{model}@{revision}/layer-{self.layer}/{self.family}/{int(self.opened_wall * 1000)}"

    def involved(self) -> list[str]:
        """Heads named in at least ``HEAD_SHARE`` of the primary traces' findings, most
        often first (a head finding names one head; a trace may raise several)."""
        if not self.traces:
            return []
        return [h for h, n in self.heads.most_common() if n >= HEAD_SHARE * self.traces]

    def summary(self) -> dict[str, Any]:
        model, revision = self.key
        return {
            "incident_id": self.id, "model_id": model, "model_revision": revision, "layer": self.layer,
            "family": self.family, "reference_revision": self.reference_revision, "opened_at": self.opened_wall,
            "state": "closed" if self.closed_at is not None else "open", "anomalies": self.anomalies,
            "traces": self.traces, "kinds": dict(self.kinds), "heads": self.involved(),
            "head_counts": dict(self.heads), "side_effects": dict(self.side_effects), "strongest": self.strongest,
            "also_changed": [a.summary() for _, a in sorted(self.also_changed.items())],
        }


@dataclass(frozen=True)
class Change:
    """An incident opened, updated (a layer annotated, or an annotation paged) or closed."""

    what: str  #: "opened", "updated" or "closed"
    incident: Incident


class IncidentTracker:
    def __init__(self, quiet: float, max_open: int = 10_000):
        if quiet <= 0:
            raise ValueError("the quiet period must be positive")
        self.quiet = quiet
        self.max_open = max_open
        self.open: dict[RevisionKey, Incident] = {}

    def observe(self, model: str, revision: str, layer: int, anomalies: list[Anomaly],
                records: list[dict[str, Any]], now: float, wall: float) -> list[Change]:
        """Account for one trace's findings (``records`` are their published records, in
        the same order); returns what changed."""
        key = (model, revision)
        incident = self.open.get(key)
        changes: list[Change] = []
        if not anomalies:
            return changes
        if incident is None:
            paging = [(a, r) for a, r in zip(anomalies, records, strict=True) if a.pages]
            if not paging or len(self.open) >= self.max_open:
                return changes  # evidence only (bounded: beyond the cap, findings stay evidence)
            first, _ = min(paging, key=lambda pair: FAMILY[pair[0].kind] != "diversity")
            incident = self.open[key] = Incident(key, layer, FAMILY[first.kind], now, now, wall,
                                                 reference_revision=first.reference_revision)
            changes.append(Change("opened", incident))
        incident.last_at = now
        if layer != incident.layer:
            note = incident.also_changed.get(layer)
            fresh = note is None
            if note is None:
                note = incident.also_changed[layer] = Annotation(
                    layer, "downstream" if layer > incident.layer else "upstream")
            newly_paged = not note.paged and any(a.pages for a in anomalies)
            note.findings += len(anomalies)
            note.kinds.update(a.kind for a in anomalies)
            note.paged |= newly_paged
            if (fresh or newly_paged) and not changes:
                changes.append(Change("updated", incident))
            return changes
        primary = [(a, r) for a, r in zip(anomalies, records, strict=True) if FAMILY[a.kind] == incident.family]
        incident.side_effects.update(a.kind for a in anomalies if FAMILY[a.kind] != incident.family)
        incident.heads.update(dict.fromkeys(h for anomaly, _ in primary for h in anomaly.heads).keys())
        for anomaly, record in primary:
            incident.anomalies += 1
            incident.kinds[anomaly.kind] += 1
            if not incident.strongest or anomaly.effect > incident.strongest.get("effect_size", float("-inf")):
                incident.strongest = record
        if primary:
            incident.traces += 1
        return changes

    def state(self, keys: Iterable[RevisionKey], now: float) -> list[dict[str, Any]]:
        """The open incidents of these revisions as JSON-able values, their times as ages
        (``now`` is this tracker's clock), for :meth:`restore` on another tracker."""
        out = []
        for key in sorted(set(keys) & self.open.keys()):
            i = self.open[key]
            out.append({"key": list(key), "layer": i.layer, "family": i.family, "open_for": now - i.opened_at,
                        "quiet_for": now - i.last_at, "opened_wall": i.opened_wall, "anomalies": i.anomalies,
                        "traces": i.traces, "kinds": dict(i.kinds), "heads": dict(i.heads),
                        "side_effects": dict(i.side_effects), "strongest": i.strongest,
                        "reference_revision": i.reference_revision,
                        "also_changed": [{"layer": a.layer, "relation": a.relation, "findings": a.findings,
                                          "paged": a.paged, "kinds": dict(a.kinds)}
                                         for a in i.also_changed.values()]})
        return out

    def restore(self, docs: Iterable[dict[str, Any]], now: float) -> None:
        """Take over open incidents from :meth:`state` (they stay open: the findings that
        follow update them, not a new page)."""
        for d in docs:
            model, revision = d["key"]
            key = (str(model), str(revision))
            self.open[key] = Incident(
                key, int(d["layer"]), str(d["family"]), now - float(d["open_for"]), now - float(d["quiet_for"]),
                float(d["opened_wall"]), int(d["anomalies"]), int(d["traces"]), Counter(d["kinds"]),
                Counter(d["heads"]), Counter(d["side_effects"]),
                {int(a["layer"]): Annotation(int(a["layer"]), str(a["relation"]), int(a["findings"]),
                                             bool(a["paged"]), Counter(a["kinds"])) for a in d["also_changed"]},
                dict(d["strongest"]), str(d["reference_revision"]))

    def expire(self, now: float) -> list[Change]:
        """Close the incidents quiet for ``quiet`` seconds."""
        done = [key for key, incident in self.open.items() if now - incident.last_at >= self.quiet]
        changes = []
        for key in done:
            incident = self.open.pop(key)
            incident.closed_at = now
            changes.append(Change("closed", incident))
        return changes
