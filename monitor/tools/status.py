"""``attention-monitor status``: which reference judges every layer, whether it is ready,
what nothing judges, and which incidents are open; from the saved reference state and
the live services' ``/metrics`` (one instance's, or every instance's as one view)."""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from monitor.core.detect import Detector, DetectorConfig
from monitor.tools import outcome_status
from monitor.tools.outcome_status import OutcomeCounts

Layer = tuple[str, str, int]


@dataclass
class LayerStatus:
    judged_by: str = "-"
    reference_traces: float | None = None
    ready: bool | None = None
    traces: float = 0.0
    unjudged: dict[str, float] = field(default_factory=dict)
    incidents: list[str] = field(default_factory=list)
    #: per family of an open incident: the heads it names, with the traces naming each
    heads: dict[str, dict[str, float]] = field(default_factory=dict)
    #: whether a live instance read gave the layer a verdict: None without a live view of
    #: it; False while those read only measured it (another instance judges it, or its
    #: first traces have not reached their judge yet)
    verdicts: bool | None = None


@dataclass
class Status:
    layers: dict[Layer, LayerStatus] = field(default_factory=lambda: defaultdict(LayerStatus))
    decisions: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unmatched_pins: list[tuple[str, str, str]] = field(default_factory=list)  #: (model, revision, reference)
    #: (layer, metric) a live instance reported: it overrides the saved state's value
    live: set[tuple[Layer, str]] = field(default_factory=set)
    #: every revision's outcomes, added up over the live instances
    outcomes: OutcomeCounts = field(default_factory=OutcomeCounts)
    answered: int = 0  #: live instances whose /metrics were read


def from_state(status: Status, folder: Path, config: DetectorConfig) -> None:
    """Merge every instance's state file in ``folder`` (as a restart would)."""
    files = sorted(folder.glob("reference-*.json")) if folder.is_dir() else []
    if not files:
        status.notes.append(f"no reference state in {folder}")
        return
    detector = Detector(config)
    for path in files:
        try:
            detector.merge_state(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            status.notes.append(f"{path}: unusable ({exc})")
    for (model, revision, layer), ref in detector.references.items():
        row = status.layers[(model, revision, layer)]
        row.reference_traces = float(ref.traces)
        row.ready = ref.traces >= config.reference_traces
    for (model, revision), decision in sorted(detector.decisions.items()):
        status.decisions.append({"model": model, "revision": revision, **decision.to_dict()})


def from_metrics(status: Status, text: str) -> None:
    """Add one instance's /metrics to ``status``; called once per instance, it gives the
    fleet's view: traces and unjudged traces add up, a layer's reference is the one
    holding the most traces, and it is ready when the instance that judges it says so
    (the others measure the layer and report 0); outcomes add up too
    (:mod:`monitor.tools.outcome_status`)."""
    status.outcomes.add(text)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "attention_monitor_pin_unmatched" and sample.value == 1:
                pin = (labels["model"], labels["revision"], labels["reference"])
                if pin not in status.unmatched_pins:
                    status.unmatched_pins.append(pin)
            if "layer" not in labels or "model" not in labels:
                continue
            key = (labels["model"], labels["revision"], int(labels["layer"]))
            row = status.layers[key]
            row.verdicts = row.verdicts or _verdict(sample.name, sample.value)
            if sample.name == "attention_traces_total":
                row.traces += sample.value
            elif sample.name == "attention_reference_ready":
                ready = sample.value == 1
                first = (key, sample.name) not in status.live
                row.ready = ready if first or row.ready is None else row.ready or ready
                status.live.add((key, sample.name))
            elif sample.name == "attention_reference_traces":
                first = (key, sample.name) not in status.live
                row.reference_traces = sample.value if first else max(row.reference_traces or 0.0, sample.value)
                status.live.add((key, sample.name))
            elif sample.name == "attention_reference_judge" and sample.value == 1:
                row.judged_by = labels["reference"]
            elif sample.name == "attention_traces_unjudged_total" and sample.value:
                row.unjudged[labels["reason"]] = row.unjudged.get(labels["reason"], 0.0) + sample.value
            elif sample.name == "attention_incident_open" and sample.value == 1 and \
                    labels["family"] not in row.incidents:
                row.incidents.append(labels["family"])
            elif sample.name == "attention_incident_heads" and sample.value > 0:
                named = row.heads.setdefault(labels["family"], {})
                named[labels["head"]] = max(named.get(labels["head"], 0.0), sample.value)


def _verdict(name: str, value: float) -> bool:
    """Whether this sample says its instance judged the layer (an instance that only
    measures a layer exports its reference gauges at 0 and counts no unjudged trace)."""
    return value > 0 and name in ("attention_reference_traces", "attention_reference_ready",
                                  "attention_reference_judge", "attention_traces_unjudged_total")


def scrape(url: str, basic_auth: tuple[str, str] | None = None, cafile: Path | None = None,
           timeout: float = 10.0) -> str:
    request = urllib.request.Request(url)
    if basic_auth is not None:
        token = base64.b64encode(f"{basic_auth[0]}:{basic_auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    context = ssl.create_default_context(cafile=str(cafile)) if cafile is not None else None
    with urllib.request.urlopen(request, timeout=timeout, context=context) as resp:
        text: str = resp.read().decode()
    return text


def table(header: list[str], rows: list[list[str]], right: frozenset[int] = frozenset()) -> list[str]:
    """Lines of a plain-text table whose every column is as wide as its longest value
    (columns ``right`` aligned right), two spaces apart; trailing blanks trimmed."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths,
                                                                                                      strict=True)))
            .rstrip() for row in [header, *rows]]


def _incident(family: str, heads: dict[str, float]) -> str:
    """An open incident: its family and the heads it names, with the traces naming each."""
    named = sorted(heads.items(), key=lambda item: -item[1])
    return family + (": " + ", ".join(f"{head} ({n:.0f})" for head, n in named) if named else "")


def report(status: Status, reference_traces: int) -> str:
    rows = []
    for (model, revision, layer), row in sorted(status.layers.items()):
        held = "-" if row.reference_traces is None else f"{row.reference_traces:.0f}/{reference_traces}"
        ready = {True: " ready", False: " learning", None: ""}[row.ready]
        if row.verdicts is False:
            held, ready = "-", " (no verdict here)"
        unjudged = ", ".join(f"{reason} {count:.0f}" for reason, count in sorted(row.unjudged.items())) or "-"
        incidents = "; ".join(_incident(family, row.heads.get(family, {})) for family in row.incidents) or "-"
        rows.append([model, revision, str(layer), row.judged_by, held + ready, f"{row.traces:.0f}", unjudged,
                     incidents])
    lines = table(["model", "revision", "layer", "judged by", "reference", "traces", "unjudged",
                   "incidents (heads named)"], rows, right=frozenset({2, 5}))
    if not status.layers:
        lines.append("(no layer seen yet)")
    lines += ["", "Reference decisions (saved state):"]
    for d in status.decisions:
        what = f"pinned to {d['pinned_to']}" if d["pinned_to"] else "its own reference (promoted)"
        lines.append(f"  {d['model']} {d['revision']}: {what} ({d['source']})")
    if not status.decisions:
        lines.append("  none: every revision learns its own reference from its first traces")
    for model, revision, reference in sorted(status.unmatched_pins):
        seen = sorted({r for m, r, _ in status.layers if m == model and r not in (revision, reference)})
        lines.append(f"WARNING: {model} {revision} is pinned to {reference}, but no contract has revision "
                     f"{revision}: " + (f"traces of {model} carry {', '.join(seen)}; if that is the canary, it is "
                                        "not pinned (pin the revision its traces carry)" if seen else
                                        "no traces of it yet"))
    lines += outcome_status.report(status.outcomes)
    if any(row.verdicts is False for row in status.layers.values()):
        lines.append("note: no verdict here: none of the instances read judged the layer; another instance judges "
                     "it (give every instance's /metrics, --url once each) or its first traces are on their way "
                     "to their judge")
    lines += [f"note: {note}" for note in status.notes]
    return "\n".join(lines) + "\n"


def gather(state_dir: Path | None, urls: list[str], config: DetectorConfig,
           basic_auth: tuple[str, str] | None = None, cafile: Path | None = None) -> Status:
    """The saved state and every instance's /metrics (``urls``) as one view."""
    status = Status()
    if state_dir is not None:
        from_state(status, state_dir, config)
    else:
        status.notes.append("ATTENTION_MONITOR_STATE_DIR is not set where this command runs: no saved reference "
                            "state read (set it to an instance's STATE_DIR to read its pins and promotions)")
    for url in urls:
        if "://" not in url:
            url = f"http://{url}"  # host:port/metrics, as Prometheus targets are written
        try:
            from_metrics(status, scrape(url, basic_auth, cafile))
            status.answered += 1
        except (urllib.error.URLError, OSError, ValueError) as exc:
            status.notes.append(f"the live service at {url} did not answer ({exc}); its view is missing")
    return status
