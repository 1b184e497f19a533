"""Incidents: what on-call is paged for, one per fault of a model revision.

Findings (anomaly records) are evidence; most never page. An incident opens only on a
finding whose evidence crossed the *page* threshold (``Anomaly.pages``, calibrated to the
false-page budget: :mod:`monitor.core.detect`), and one fault gives one incident, whose
key is the (model, revision): the layer and family of that first paging finding are the
incident's *primary* and never change while it is open, so its alert keeps its labels.

A fault on one layer changes the layers after it too (through the residual stream), and
one layer's fault shows in several kinds of finding. While an incident is open, every
finding of the revision is counted in it: on the primary layer, findings of the primary
family are its evidence and the other kinds its side effects; on any other layer they
are annotations (``also_changed``: downstream after the primary layer, upstream before
it), paging or not. The incident closes after ``quiet`` seconds without a finding of its
revision.

Its evidence starts before the page: the findings of the primary layer and family in
the ``quiet`` seconds before it opened (at most ``PENDING_TRACES`` traces) are counted
in it as if it had been open, since they are what made the page statistic cross.

The heads it names are one :class:`HeadAccount`, kept here and nowhere else: the incident
record carries it, the exporter shows it on the alert (``attention_incident_heads``),
and the triage page and text read it from the record. A head is named once the findings
of at least ``HEAD_SHARE`` of the counted traces (and of two at least) name it, and stays
named while the incident is open, so every surface names the same heads and none disappears as evidence
accrues. An incident record is written when the incident opens, when it names another
head, when another layer is annotated or pages, when its account changed and the last
record is ``ACCOUNT_REFRESH_S`` old, and when it closes.

Families: ``diversity`` (``low_diversity``) and ``head`` (``entropy_collapse``,
``concentration_spike``, ``sink_shift``, ``learned_sink_shift``, ``prompt_mass_shift``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from monitor.core.detect import Anomaly

FAMILY = {"low_diversity": "diversity", "entropy_collapse": "head", "concentration_spike": "head",
          "sink_shift": "head", "learned_sink_shift": "head", "prompt_mass_shift": "head"}
FAMILIES = ("diversity", "head")
#: a head is named once the findings of at least this share of an incident's counted traces,
#: and of at least ``HEAD_MIN_TRACES`` of them, name it
HEAD_SHARE = 0.5
HEAD_MIN_TRACES = 2
#: traces of evidence kept per (model, revision, layer, family) before an incident opens
PENDING_TRACES = 64
#: an incident whose account changed is written again once its last record is this old (seconds)
ACCOUNT_REFRESH_S = 15.0
#: why an incident closed without a record: its revision is judged elsewhere now
HANDED_OVER = "handed over"
RevisionKey = tuple[str, str]  # model, revision
PendingKey = tuple[str, str, int, str]  # model, revision, layer, family


@dataclass
class HeadAccount:
    """The heads an incident's findings support, and how many of its traces' findings
    name each: counted over the traces of its primary layer with a finding of its primary
    family (a trace counts once per head, however many findings it raised). A head is
    named once it is in at least ``HEAD_SHARE`` of the traces counted so far and in
    ``HEAD_MIN_TRACES`` of them (one trace alone names no head), and stays named."""

    traces: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    named: list[str] = field(default_factory=list)  #: in the order they were named

    def add(self, heads: Iterable[str]) -> bool:
        """Count one trace whose findings name ``heads``; True when a head is newly named."""
        self.traces += 1
        self.counts.update(dict.fromkeys(heads).keys())
        fresh = [h for h, n in self.counts.most_common()
                 if h not in self.named and n >= max(HEAD_MIN_TRACES, HEAD_SHARE * self.traces)]
        self.named += fresh
        return bool(fresh)

    def heads(self) -> list[str]:
        """The named heads, those the most findings name first."""
        order = {h: i for i, h in enumerate(self.named)}
        return sorted(self.named, key=lambda h: (-self.counts[h], order[h]))

    def to_dict(self) -> dict[str, Any]:
        """As the incident record carries it: ``heads`` (named, best supported first),
        ``head_counts`` (every head the counted findings name, most named first) and the
        ``traces`` counted."""
        return {"heads": self.heads(), "head_counts": dict(self.counts.most_common()), "traces": self.traces}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> HeadAccount:
        counts = Counter({str(h): int(n) for h, n in dict(doc.get("head_counts", {})).items()})
        return cls(int(doc.get("traces", 0)), counts, [str(h) for h in doc.get("named", doc.get("heads", []))])


@dataclass(frozen=True)
class _Pending:
    """One trace's findings of a layer and family, before any incident of its revision."""

    at: float
    wall: float
    heads: tuple[str, ...]
    kinds: tuple[str, ...]
    strongest: tuple[float, dict[str, Any]]


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
    account: HeadAccount = field(default_factory=HeadAccount)  #: the heads named, and their evidence
    kinds: Counter[str] = field(default_factory=Counter)
    side_effects: Counter[str] = field(default_factory=Counter)  #: other kinds on the primary layer
    also_changed: dict[int, Annotation] = field(default_factory=dict)
    strongest: dict[str, Any] = field(default_factory=dict)  #: the primary finding of the largest effect
    reference_revision: str = ""
    closed_at: float | None = None
    evidence_since: float = 0.0  #: seconds since the epoch of the first finding counted (records)
    written_at: float = 0.0  #: when its last record was written (this tracker's clock)
    written: dict[str, Any] = field(default_factory=dict)  #: its account as that record has it

    @property
    def id(self) -> str:
        model, revision = self.key
        return f"{model}@{revision}/layer-{self.layer}/{self.family}/{int(self.opened_wall * 1000)}"

    @property
    def traces(self) -> int:
        """Traces of the primary layer with a finding of the primary family."""
        return self.account.traces

    def involved(self) -> list[str]:
        """The heads the incident names (:class:`HeadAccount`), best supported first."""
        return self.account.heads()

    def named_counts(self) -> dict[str, int]:
        """The heads named by its latest record, best supported first, with the traces
        naming each: what ``attention_incident_heads`` exports."""
        counts = self.written.get("head_counts", {})
        return {str(h): int(counts.get(h, 0)) for h in self.written.get("heads", [])}

    def summary(self) -> dict[str, Any]:
        """The incident record's fields (``heads``, ``head_counts`` and ``traces`` are its
        :class:`HeadAccount`)."""
        model, revision = self.key
        return {
            "incident_id": self.id, "model_id": model, "model_revision": revision, "layer": self.layer,
            "family": self.family, "reference_revision": self.reference_revision, "opened_at": self.opened_wall,
            "evidence_since": self.evidence_since or self.opened_wall,
            "state": "closed" if self.closed_at is not None else "open", "anomalies": self.anomalies,
            **self.account.to_dict(), "kinds": dict(self.kinds), "side_effects": dict(self.side_effects),
            "strongest": self.strongest, "also_changed": [a.summary() for _, a in sorted(self.also_changed.items())],
        }

    def _count(self, heads: Iterable[str], kinds: Iterable[str], strongest: tuple[float, dict[str, Any]],
               wall: float) -> bool:
        """Count one trace's primary findings; True when a head is newly named."""
        kinds = list(kinds)
        self.anomalies += len(kinds)
        self.kinds.update(kinds)
        effect, record = strongest
        if not self.strongest or effect > self.strongest.get("effect_size", float("-inf")):
            self.strongest = record
        if not self.evidence_since:
            self.evidence_since = wall
        return self.account.add(heads)


@dataclass(frozen=True)
class Change:
    """An incident opened, updated or closed: each is an incident record to write."""

    what: str  #: "opened", "updated" or "closed"
    incident: Incident
    #: of an update: "heads" (another head named), "layers" (a layer annotated, or an
    #: annotation paged) or "account" (more evidence, its last record ACCOUNT_REFRESH_S old);
    #: of a closing, HANDED_OVER (no record: another tracker judges the revision now)
    reason: str = ""


class IncidentTracker:
    def __init__(self, quiet: float, max_open: int = 10_000):
        if quiet <= 0:
            raise ValueError("the quiet period must be positive")
        self.quiet = quiet
        self.max_open = max_open
        self.open: dict[RevisionKey, Incident] = {}
        #: open incidents of revisions judged elsewhere now (:meth:`hand_over`)
        self.handed: set[RevisionKey] = set()
        #: evidence of layers and families of revisions without an open incident (bounded)
        self._pending: OrderedDict[PendingKey, deque[_Pending]] = OrderedDict()

    def observe(self, model: str, revision: str, layer: int, anomalies: list[Anomaly],
                records: list[dict[str, Any]], now: float, wall: float) -> list[Change]:
        """Account for one trace's findings (``records`` are their published records, in
        the same order); returns what changed."""
        key = (model, revision)
        incident = self.open.get(key)
        if not anomalies:
            return []
        if incident is None:
            paging = [a for a in anomalies if a.pages]
            if not paging or len(self.open) >= self.max_open:
                self._remember(model, revision, layer, anomalies, records, now, wall)
                return []  # evidence only (bounded: beyond the cap, findings stay evidence)
            first = min(paging, key=lambda a: FAMILY[a.kind] != "diversity")
            incident = self.open[key] = Incident(key, layer, FAMILY[first.kind], now, now, wall,
                                                 reference_revision=first.reference_revision)
            for before in self._take_pending(key, layer, incident.family, now):
                incident._count(before.heads, before.kinds, before.strongest, before.wall)
            incident.side_effects.update(a.kind for a in anomalies if FAMILY[a.kind] != incident.family)
            self._count(incident, anomalies, records, wall)
            return [self._written(Change("opened", incident), now)]
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
            return [self._written(Change("updated", incident, "layers"), now)] if fresh or newly_paged else []
        incident.side_effects.update(a.kind for a in anomalies if FAMILY[a.kind] != incident.family)
        named = self._count(incident, anomalies, records, wall)
        if named:
            return [self._written(Change("updated", incident, "heads"), now)]
        if incident.account.to_dict() != incident.written and now - incident.written_at >= ACCOUNT_REFRESH_S:
            return [self._written(Change("updated", incident, "account"), now)]
        return []

    @staticmethod
    def _count(incident: Incident, anomalies: list[Anomaly], records: list[dict[str, Any]], wall: float) -> bool:
        primary = [(a, r) for a, r in zip(anomalies, records, strict=True) if FAMILY[a.kind] == incident.family]
        if not primary:
            return False
        heads = (h for a, _ in primary for h in a.heads)
        strongest = max(((a.effect, r) for a, r in primary), key=lambda pair: pair[0])
        return incident._count(heads, (a.kind for a, _ in primary), strongest, wall)

    @staticmethod
    def _written(change: Change, now: float) -> Change:
        change.incident.written_at = now
        change.incident.written = change.incident.account.to_dict()
        return change

    def _remember(self, model: str, revision: str, layer: int, anomalies: list[Anomaly],
                  records: list[dict[str, Any]], now: float, wall: float) -> None:
        """Keep a trace's findings, per family, as evidence of an incident that may open."""
        for family in FAMILIES:
            mine = [(a, r) for a, r in zip(anomalies, records, strict=True) if FAMILY[a.kind] == family]
            if not mine:
                continue
            key = (model, revision, layer, family)
            kept = self._pending.get(key)
            if kept is None:
                while len(self._pending) >= 4 * self.max_open:
                    self._pending.popitem(last=False)
                kept = self._pending[key] = deque(maxlen=PENDING_TRACES)
            self._pending.move_to_end(key)
            strongest = max(((a.effect, r) for a, r in mine), key=lambda pair: pair[0])
            kept.append(_Pending(now, wall, tuple(h for a, _ in mine for h in a.heads), tuple(a.kind for a, _ in mine),
                                 strongest))

    def _take_pending(self, key: RevisionKey, layer: int, family: str, now: float) -> list[_Pending]:
        """The evidence kept of the layer and family in the last ``quiet`` seconds, oldest
        first; the revision's other kept evidence is dropped (its incident is open now)."""
        taken: list[_Pending] = []
        for pending in [k for k in self._pending if k[:2] == key]:
            kept = self._pending.pop(pending)
            if pending[2:] == (layer, family):
                taken = [p for p in kept if now - p.at < self.quiet]
        return taken

    def state(self, keys: Iterable[RevisionKey], now: float) -> list[dict[str, Any]]:
        """The open incidents of these revisions as JSON-able values, their times as ages
        (``now`` is this tracker's clock), for :meth:`restore` on another tracker."""
        out = []
        for key in sorted(set(keys) & self.open.keys()):
            i = self.open[key]
            out.append({"key": list(key), "layer": i.layer, "family": i.family, "open_for": now - i.opened_at,
                        "quiet_for": now - i.last_at, "opened_wall": i.opened_wall, "anomalies": i.anomalies,
                        "account": {**i.account.to_dict(), "named": list(i.account.named)},
                        "written_for": now - i.written_at, "written": i.written, "evidence_since": i.evidence_since,
                        "kinds": dict(i.kinds), "side_effects": dict(i.side_effects), "strongest": i.strongest,
                        "reference_revision": i.reference_revision,
                        "also_changed": [{"layer": a.layer, "relation": a.relation, "findings": a.findings,
                                          "paged": a.paged, "kinds": dict(a.kinds)}
                                         for a in i.also_changed.values()]})
        return out

    def restore(self, docs: Iterable[dict[str, Any]], now: float) -> None:
        """Take over open incidents from :meth:`state` (they stay open: the findings that
        follow update them, not a new page). A state written before the heads account
        (``traces`` and ``heads`` counts) restores as one."""
        for d in docs:
            model, revision = d["key"]
            key = (str(model), str(revision))
            if "account" in d:
                account = HeadAccount.from_dict(d["account"])
            else:
                counts = Counter({str(h): int(n) for h, n in d.get("heads", {}).items()})
                traces = int(d.get("traces", 0))
                account = HeadAccount(traces, counts, [h for h, n in counts.most_common()
                                                       if n >= max(HEAD_MIN_TRACES, HEAD_SHARE * traces)])
            self.handed.discard(key)
            self.open[key] = Incident(
                key, int(d["layer"]), str(d["family"]), now - float(d["open_for"]), now - float(d["quiet_for"]),
                float(d["opened_wall"]), int(d["anomalies"]), account, Counter(d["kinds"]),
                Counter(d["side_effects"]),
                {int(a["layer"]): Annotation(int(a["layer"]), str(a["relation"]), int(a["findings"]),
                                             bool(a["paged"]), Counter(a["kinds"])) for a in d["also_changed"]},
                dict(d["strongest"]), str(d["reference_revision"]), None, float(d.get("evidence_since", 0.0)),
                now - float(d.get("written_for", 0.0)), dict(d.get("written") or account.to_dict()))

    def hand_over(self, keys: Iterable[RevisionKey]) -> None:
        """These revisions are judged by another tracker from now on (it took their open
        incidents over, :meth:`restore`): here they only wait to go quiet, and close
        then as "handed over", which is no record (the other tracker writes what
        follows; a "closed" from here would contradict it while the fault goes on)."""
        self.handed |= set(keys) & self.open.keys()

    def expire(self, now: float) -> list[Change]:
        """Close the incidents quiet for ``quiet`` seconds, and forget evidence as old."""
        done = [key for key, incident in self.open.items() if now - incident.last_at >= self.quiet]
        changes = []
        for key in done:
            incident = self.open.pop(key)
            incident.closed_at = now
            reason = HANDED_OVER if key in self.handed else ""
            self.handed.discard(key)
            changes.append(self._written(Change("closed", incident, reason), now))
        for stale in [k for k, kept in self._pending.items() if not kept or now - kept[-1].at >= self.quiet]:
            del self._pending[stale]
        return changes
