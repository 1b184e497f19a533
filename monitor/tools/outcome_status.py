"""``attention-monitor status``'s outcomes: each revision's failure rate against the
revision whose reference judges it, from the live instances' ``/metrics`` (added up over
instances: each counts the traces of the partitions it owns).

A revision's counts are its layers' ``attention_trace_outcomes_total``, averaged over its
layers (each request counts once a layer, so the average is about its requests); an
outcome that came after the join window is in them once it came, and
``attention_trace_outcomes_pending`` says how many still await one. Counters start at
zero when an instance starts: this is since then.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from monitor.triage.outcomes import Group, Rate, difference, rate_text

Layer = tuple[str, str, int]


@dataclass
class OutcomeCounts:
    """Per (model, revision, layer): traces by outcome and still pending, added over
    instances; which revision judges each revision."""

    counts: dict[Layer, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    judged_by: dict[tuple[str, str], str] = field(default_factory=dict)

    def add(self, text: str) -> None:
        """One instance's /metrics."""
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = sample.labels
                if "layer" not in labels or "model" not in labels or labels.get("layer") == "other":
                    continue
                key = (labels["model"], labels["revision"], int(labels["layer"]))
                if sample.name == "attention_trace_outcomes_total":
                    self.counts[key][labels["outcome"]] += sample.value
                elif sample.name == "attention_trace_outcomes_pending":
                    self.counts[key]["pending"] += sample.value
                elif sample.name == "attention_reference_judge" and sample.value == 1:
                    self.judged_by[(labels["model"], labels["revision"])] = labels["reference"]

    def group(self, model: str, revision: str) -> Group | None:
        """The revision's counts, averaged over its layers (None when it has none)."""
        layers = [c for (m, r, _), c in self.counts.items() if (m, r) == (model, revision)]
        if not layers:
            return None

        def mean(outcome: str) -> int:
            return round(sum(c.get(outcome, 0.0) for c in layers) / len(layers))

        failures = mean("failure")
        return Group(f"{model} {revision}", Rate(failures, failures + mean("success")), mean("pending"),
                     mean("missing"))


def report(counts: OutcomeCounts) -> list[str]:
    """Lines for ``status``: every revision with outcomes, against its reference."""
    revisions = sorted({(m, r) for m, r, _ in counts.counts})
    if not revisions:
        return []
    lines = ["", "Outcomes (failure: the outcome says failure; per layer, averaged over layers; late outcomes "
             "included once they came):"]
    for model, revision in revisions:
        mine = counts.group(model, revision)
        assert mine is not None
        lines.append(f"  {model} {revision}: {rate_text(mine)}")
        reference = counts.judged_by.get((model, revision))
        theirs = counts.group(model, reference) if reference and reference != revision else None
        if theirs is not None:
            line = f"    against its reference {reference}: {rate_text(theirs)}"
            found = difference(mine.rate, theirs.rate)
            if found is not None:
                line += f"; difference {found[0]:+.3f} (95 % {found[1]:+.3f} to {found[2]:+.3f})"
            lines.append(line)
    return lines
