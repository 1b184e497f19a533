"""The layers this instance has seen, as its own metrics count them: every (model,
revision, layer) whose traces it measured or judged, with the revision whose reference
judges it and whether that reference is ready (what ``attention-monitor status`` reads
from ``/metrics``), the findings raised on it here, its open incidents, and the model
contracts that declare the layer.

The triage index lists them, each linked to its page; a layer page takes what its
records do not say (a healthy layer has no anomaly record to name its judge or its
contract) from them; and a layer that neither they nor any record names answers 404,
so that a typo never reads as a healthy layer. Labels the exporter bounded (``other``
beyond ``MAX_MODEL_REVISIONS`` or ``MAX_LAYER_SERIES``) are what it counts under."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric

from monitor.protocol.model_contract import ModelContract

#: (model, revision, layer)
Key = tuple[str, str, int]


@dataclass
class SeenLayer:
    """One layer as this instance's metrics have it."""

    model: str
    revision: str
    layer: int
    traces: int = 0  #: traces of it measured here (``attention_traces_total``)
    judged_by: str | None = None  #: the revision whose reference judges it (``attention_reference_judge``)
    reference_traces: int | None = None  #: traces that reference holds (``attention_reference_traces``)
    ready: bool | None = None  #: whether it judges (``attention_reference_ready``)
    findings: int = 0  #: anomalies raised on it here (``attention_anomalies_total``)
    #: traces nothing judged, by reason: learning, no_reference (``attention_traces_unjudged_total``)
    unjudged: dict[str, int] = field(default_factory=dict)
    incidents: list[str] = field(default_factory=list)  #: families of its open incidents
    contract_ids: list[str] = field(default_factory=list)  #: contracts of its revision declaring the layer

    @property
    def key(self) -> Key:
        return self.model, self.revision, self.layer

    @property
    def reference(self) -> str:
        """The judging reference's state, in words: ready, learning or none."""
        held = "" if self.reference_traces is None else f" ({self.reference_traces} traces)"
        if self.ready:
            return "ready" + held
        if self.unjudged.get("no_reference"):
            return "not ready: pinned to a reference still learning" + held
        if self.unjudged.get("learning"):
            return "learning" + held
        return "no verdict here (another instance may judge it)"

    @property
    def not_judged(self) -> str | None:
        """Why no finding can be raised on the layer here yet (None: a ready reference
        judges its traces)."""
        if self.ready and self.judged_by:
            return None
        if self.ready:
            return (f"its reference is ready ({self.reference_traces} traces), but every trace seen so far taught it: "
                    "none was judged yet")
        return f"the reference is {self.reference}"


def from_metrics(families: Iterable[Metric], contracts: Iterable[ModelContract] = ()) -> dict[Key, SeenLayer]:
    """The layers in ``families`` (a registry's ``collect()``, or a parsed exposition)
    that traces were measured or judged on, in (model, revision, layer) order, each with
    the ids of the ``contracts`` of its model revision that declare it."""
    found: dict[Key, SeenLayer] = {}
    for family in families:
        for sample in family.samples:
            labels = sample.labels
            try:
                key = (labels["model"], labels["revision"], int(labels["layer"]))
            except (KeyError, ValueError):  # no layer, or the overflow's "other"
                continue
            layer = found.setdefault(key, SeenLayer(*key))
            _take(layer, sample.name, labels, sample.value)
    seen = {key: layer for key, layer in sorted(found.items())
            if layer.traces or layer.judged_by or layer.reference_traces}
    for contract in contracts:
        for spec in contract.layers:
            known = seen.get((contract.model_id, contract.model_revision, spec.layer))
            if known is not None and contract.contract_id not in known.contract_ids:
                known.contract_ids.append(contract.contract_id)
    return seen


def _take(layer: SeenLayer, name: str, labels: dict[str, str], value: float) -> None:
    """One sample's part of a layer."""
    if name == "attention_traces_total":
        layer.traces += int(value)
    elif name == "attention_reference_judge" and value == 1:
        layer.judged_by = labels["reference"]
    elif name == "attention_reference_traces":
        layer.reference_traces = int(value)
    elif name == "attention_reference_ready":
        layer.ready = value == 1
    elif name == "attention_anomalies_total":
        layer.findings += int(value)
    elif name == "attention_traces_unjudged_total" and value:
        layer.unjudged[labels["reason"]] = layer.unjudged.get(labels["reason"], 0) + int(value)
    elif name == "attention_incident_open" and value == 1:
        layer.incidents.append(labels["family"])
