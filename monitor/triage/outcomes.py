"""What the task outcomes of a triage selection say, as two contrasts that answer two
different questions:

- **The revision against the revision whose reference judges it** (its pinned reference):
  *did this deploy hurt users?* For a fault of the whole revision (weights, kernel,
  quantisation) every trace is affected, so this is the contrast that shows it.
- **The selection's anomalous traces against the revision's other traces**: *within
  this revision, do the traces whose attention looks anomalous fail more?* It points at
  an input-dependent fault (some prompts, lengths, tenants); for a fault of the whole
  revision both groups are faulty and it says little.

Both are correlational, never causal. The counts come from the records the monitor
wrote: anomaly records carry their layer's outcome tallies (``layer_outcomes``) and, for
a revision judged by another one, that revision's on the same layer
(``reference_outcomes``); an outcome that came after the join window is written as its own
``attention-outcome/1`` record, with the tallies after it, and counts for the anomaly
records of its request (``docs/wire-format.md``). The newest tallies read are used.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

#: two-sided 95 % normal quantile, for the intervals of failure rates
Z95 = 1.959963984540054
#: outcomes that are known (the others: ``pending``, still awaited; ``missing``, never came)
KNOWN = ("success", "failure")
OUTCOME_SCHEMA = "attention-outcome"


@dataclass(frozen=True)
class Rate:
    """A failure rate with its Wilson score 95 % interval."""

    failures: int
    joined: int  #: traces with a known outcome

    @property
    def value(self) -> float:
        return self.failures / self.joined if self.joined else math.nan

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.failures, self.joined)


@dataclass(frozen=True)
class Group:
    """One side of a contrast: what it is, its failure rate, and its traces whose
    outcome is still awaited (``pending``) or never came (``missing``)."""

    name: str
    rate: Rate
    pending: int = 0
    missing: int = 0


@dataclass(frozen=True)
class Contrast:
    """A group against a baseline: their failure rates and the difference."""

    question: str
    group: Group
    baseline: Group | None  #: None when the records carry no baseline

    @property
    def difference(self) -> tuple[float, float, float] | None:
        """Rate difference (group − baseline) with Newcombe's hybrid score interval."""
        return None if self.baseline is None else difference(self.group.rate, self.baseline.rate)


@dataclass(frozen=True)
class Outcomes:
    """The outcome side of a triage selection."""

    revision: Contrast | None  #: the revision against its judging reference revision
    anomalous: Contrast | None  #: the anomalous traces against the revision's other traces
    reference_revision: str | None  #: the revision whose reference judges it, when another one
    late: int = 0  #: anomalous traces whose outcome came after the join window
    labels: dict[str, int] = field(default_factory=dict)  #: labels of the anomalous traces' outcomes
    score: tuple[float, int] | None = None  #: mean score of the anomalous traces' outcomes, and how many


REVISION_QUESTION = "Did this revision hurt users, compared with the revision whose reference judges it?"
ANOMALOUS_QUESTION = "Within this revision, do the traces whose attention looks anomalous fail more?"


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (NaN, NaN without observations)."""
    if n <= 0:
        return math.nan, math.nan
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


def difference(a: Rate, b: Rate) -> tuple[float, float, float] | None:
    """``a − b`` with Newcombe's hybrid score 95 % interval (None when either is empty)."""
    if not a.joined or not b.joined:
        return None
    (l1, u1), (l2, u2) = a.interval, b.interval
    d = a.value - b.value
    return d, d - math.hypot(a.value - l1, u2 - b.value), d + math.hypot(u1 - a.value, b.value - l2)


def late_outcomes(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The outcome records among ``records`` by request id (the first of a request: the
    monitor writes one per request)."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        if str(r.get("schema", "")).startswith(OUTCOME_SCHEMA) and isinstance(r.get("request_id"), str):
            out.setdefault(r["request_id"], r)
    return out


def resolved(record: dict[str, Any], late: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """An anomaly record's outcome, label and score: its own, or, when it was written
    with the outcome still awaited, those of its request's late outcome record (``late``:
    :func:`late_outcomes`); ``late`` says which."""
    own = {"outcome": record.get("outcome"), "label": record.get("outcome_label"),
           "score": record.get("outcome_score"), "late": False}
    if own["outcome"] in KNOWN:
        return own
    found = late.get(str(record.get("request_id")))
    if found is None or found.get("outcome") not in KNOWN:
        return own
    return {"outcome": found["outcome"], "label": found.get("label"), "score": found.get("score"), "late": True}


def view(selection: list[dict[str, Any]], records: list[dict[str, Any]], model: str | None, revision: str | None,
         layer: int | None) -> Outcomes | None:
    """The outcomes of the anomaly records ``selection`` (of one model revision's layer),
    with the tallies and late outcomes found among every record read (``records``)."""
    late = late_outcomes(records)
    by_trace: dict[str, dict[str, Any]] = {}
    came_late = 0
    for r in selection:
        trace = str(r.get("trace_id"))
        if trace in by_trace:
            continue
        outcome = resolved(r, late)
        came_late += outcome["late"]
        by_trace[trace] = outcome
    tally, reference = _tallies(selection, list(late.values()), model, revision, layer)
    if not by_trace and tally is None:
        return None
    counts = Counter(str(o["outcome"]) for o in by_trace.values())
    anomalous = Group("anomalous traces of this selection", Rate(counts["failure"], counts["failure"] +
                                                                 counts["success"]),
                      pending=counts["pending"] + counts["None"], missing=counts["missing"])
    others = None
    if tally is not None:
        failures = max(0, _count(tally, "failure") - counts["failure"])
        successes = max(0, _count(tally, "success") - counts["success"])
        others = Group("the revision's other traces of this layer", Rate(failures, failures + successes),
                       max(0, _count(tally, "pending") - anomalous.pending),
                       max(0, _count(tally, "missing") - anomalous.missing))
    revision_contrast = None
    reference_revision = None if reference is None else str(reference.get("revision"))
    if tally is not None:
        mine = Group(f"revision {revision}", _rate(tally), _count(tally, "pending"), _count(tally, "missing"))
        theirs = None if reference is None else Group(
            f"reference revision {reference_revision}", _rate(reference), _count(reference, "pending"),
            _count(reference, "missing"))
        revision_contrast = Contrast(REVISION_QUESTION, mine, theirs)
    labels = Counter(str(o["label"]) for o in by_trace.values() if o["outcome"] in KNOWN and o["label"])
    scores = [float(o["score"]) for o in by_trace.values() if o["outcome"] in KNOWN and
              isinstance(o["score"], int | float)]
    return Outcomes(revision_contrast, Contrast(ANOMALOUS_QUESTION, anomalous, others), reference_revision, came_late,
                    dict(labels.most_common()), (sum(scores) / len(scores), len(scores)) if scores else None)


def _tallies(selection: list[dict[str, Any]], late: list[dict[str, Any]], model: str | None, revision: str | None,
             layer: int | None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The newest outcome tallies of the revision's layer and of its reference revision's
    same layer, from anomaly records and outcome records."""
    found: list[tuple[float, dict[str, Any], dict[str, Any] | None]] = []
    for r in selection:
        if isinstance(r.get("layer_outcomes"), dict):
            found.append((float(r.get("detected_at") or 0.0), r["layer_outcomes"], r.get("reference_outcomes")))
    for r in late:
        if (r.get("model_id"), r.get("model_revision")) != (model, revision):
            continue
        for entry in r.get("layers") or []:
            if isinstance(entry, dict) and entry.get("layer") == layer and isinstance(entry.get("layer_outcomes"),
                                                                                    dict):
                found.append((float(r.get("at") or 0.0), entry["layer_outcomes"], entry.get("reference_outcomes")))
    if not found:
        return None, None
    _, tally, reference = max(found, key=lambda f: f[0])
    return tally, reference if isinstance(reference, dict) else None


def _count(tally: dict[str, Any], outcome: str) -> int:
    try:
        return max(0, int(tally.get(outcome, 0)))
    except (TypeError, ValueError):
        return 0


def _rate(tally: dict[str, Any]) -> Rate:
    failures = _count(tally, "failure")
    return Rate(failures, failures + _count(tally, "success"))


def describe(outcomes: Outcomes | None) -> list[str]:
    """The two contrasts as text lines, each with its question (``triage`` text)."""
    if outcomes is None:
        return ["outcomes: none joined to these traces yet"]
    lines = []
    for contrast, answer in ((outcomes.revision, "the revision against its reference"),
                             (outcomes.anomalous, "the anomalous traces against the rest")):
        if contrast is None:
            continue
        lines.append(f"outcomes, {answer} ({contrast.question.lower()[:-1]}?):")
        for group in (contrast.group, contrast.baseline):
            if group is not None:
                lines.append(f"  {group.name}: {rate_text(group)}")
        if contrast.baseline is None and contrast is outcomes.revision:
            lines.append("  no reference revision's counts in the records (the revision judges itself, or they "
                         "predate them)")
        difference = contrast.difference
        if difference is not None:
            lines.append(f"  difference {difference[0]:+.3f} (95 % {difference[1]:+.3f} to {difference[2]:+.3f})")
    detail = [f"{label} {n}" for label, n in outcomes.labels.items()]
    if outcomes.score is not None:
        detail.append(f"mean score {outcomes.score[0]:.2f} of {outcomes.score[1]}")
    if outcomes.late:
        detail.append(f"{outcomes.late} came after the join window")
    if detail:
        lines.append("  anomalous traces' outcomes: " + ", ".join(detail))
    return lines


def rate_text(group: Group) -> str:
    """A group's failure rate with its interval, and its traces awaiting or without an outcome."""
    rate = group.rate
    if not rate.joined:
        text = "no outcome yet"
    else:
        low, high = rate.interval
        text = f"{rate.failures}/{rate.joined} failed = {rate.value:.3f} (95 % {low:.3f} to {high:.3f})"
    extra = [f"{n} {what}" for n, what in ((group.pending, "awaiting an outcome"), (group.missing, "never came"))
             if n]
    return text + (f"; {', '.join(extra)}" if extra else "")
