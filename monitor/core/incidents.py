"""Incidents: one per (model, revision, layer, kind family), the unit on-call pages on.

Anomaly records are evidence, and one fault raises many of them: a collapsing layer
flags low diversity on trace after trace, and the heads that collapse also shift their
entropy and concentration. An incident opens on the first anomaly of its family, keeps
the strongest evidence and counts the rest, names the heads really involved (those that
recur in its findings), and closes after ``quiet`` seconds without a new anomaly.

Families: ``diversity`` (``low_diversity``) and ``head`` (``entropy_collapse``,
``concentration_spike``, ``sink_shift``). One fault gives one page: while a diversity
incident is open on a layer, head-family findings on that layer are its side effects
(counted in it) and open no incident of their own, and a head incident already open on
the layer is closed into it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from monitor.core.detect import Anomaly

FAMILY = {"low_diversity": "diversity", "entropy_collapse": "head", "concentration_spike": "head",
          "sink_shift": "head"}
FAMILIES = ("diversity", "head")
#: heads named by an incident: those in at least this share of its findings
HEAD_SHARE = 0.5
IncidentKey = tuple[str, str, int, str]  # model, revision, layer, family


@dataclass
class Incident:
    key: IncidentKey
    opened_at: float
    last_at: float
    opened_wall: float  #: seconds since the epoch, for records
    anomalies: int = 0
    traces: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    heads: Counter[str] = field(default_factory=Counter)
    side_effects: Counter[str] = field(default_factory=Counter)
    strongest: dict[str, Any] = field(default_factory=dict)  #: the anomaly record of the largest effect
    reference_revision: str = ""
    closed_at: float | None = None
    merged_into: str | None = None

    @property
    def id(self) -> str:
        model, revision, layer, family = self.key
        return f"{model}@{revision}/layer-{layer}/{family}/{int(self.opened_wall * 1000)}"

    def involved(self) -> list[str]:
        """Heads named in at least ``HEAD_SHARE`` of the findings, most often first."""
        if not self.anomalies:
            return []
        return [h for h, n in self.heads.most_common() if n >= HEAD_SHARE * self.anomalies]

    def summary(self) -> dict[str, Any]:
        model, revision, layer, family = self.key
        return {
            "incident_id": self.id, "model_id": model, "model_revision": revision, "layer": layer, "family": family,
            "reference_revision": self.reference_revision, "opened_at": self.opened_wall,
            "state": "closed" if self.closed_at is not None else "open", "anomalies": self.anomalies,
            "traces": self.traces, "kinds": dict(self.kinds), "heads": self.involved(),
            "head_counts": dict(self.heads), "side_effects": dict(self.side_effects), "strongest": self.strongest,
            "merged_into": self.merged_into,
        }


@dataclass(frozen=True)
class Change:
    """An incident opened, or closed (by quiet, or into a diversity incident)."""

    what: str  #: "opened" or "closed"
    incident: Incident


class IncidentTracker:
    def __init__(self, quiet: float, max_open: int = 10_000):
        if quiet <= 0:
            raise ValueError("the quiet period must be positive")
        self.quiet = quiet
        self.max_open = max_open
        self.open: dict[IncidentKey, Incident] = {}

    def observe(self, model: str, revision: str, layer: int, anomalies: list[Anomaly],
                records: list[dict[str, Any]], now: float, wall: float) -> list[Change]:
        """Account for one trace's anomalies (``records`` are their published records,
        in the same order); returns the incidents opened or closed by it."""
        changes: list[Change] = []
        touched: set[IncidentKey] = set()
        ordered = sorted(zip(anomalies, records, strict=True), key=lambda pair: FAMILY[pair[0].kind] != "diversity")
        for anomaly, record in ordered:
            family = FAMILY[anomaly.kind]
            diversity = self.open.get((model, revision, layer, "diversity"))
            if family == "head" and diversity is not None:
                diversity.side_effects[anomaly.kind] += 1
                diversity.last_at = now
                continue
            key = (model, revision, layer, family)
            incident = self.open.get(key)
            if incident is None:
                if len(self.open) >= self.max_open:
                    continue  # bounded: findings beyond the cap stay evidence only
                incident = self.open[key] = Incident(key, now, now, wall, reference_revision=anomaly.reference_revision)
                changes.append(Change("opened", incident))
                if family == "diversity":
                    head = self.open.pop((model, revision, layer, "head"), None)
                    if head is not None:
                        head.closed_at, head.merged_into = now, incident.id
                        incident.side_effects.update(head.kinds)
                        changes.append(Change("closed", head))
            incident.anomalies += 1
            incident.kinds[anomaly.kind] += 1
            incident.heads.update(anomaly.heads)
            incident.last_at = now
            if key not in touched:
                incident.traces += 1
                touched.add(key)
            if not incident.strongest or anomaly.effect > incident.strongest.get("effect_size", float("-inf")):
                incident.strongest = record
        return changes

    def expire(self, now: float) -> list[Change]:
        """Close the incidents quiet for ``quiet`` seconds."""
        done = [key for key, incident in self.open.items() if now - incident.last_at >= self.quiet]
        changes = []
        for key in done:
            incident = self.open.pop(key)
            incident.closed_at = now
            changes.append(Change("closed", incident))
        return changes
