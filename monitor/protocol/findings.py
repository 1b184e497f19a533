"""The JSON records the monitor writes about what it found (``docs/wire-format.md``):
anomaly records (one finding on one trace, with the trace beside its reference) and
incident records (an incident opened or closed). Both carry the two policy sentences."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from monitor.core.detect import Anomaly, Evidence
from monitor.core.policy import policy_fields


def incident_record(summary: dict[str, Any], change: str, now: float) -> dict[str, Any]:
    """The JSON incident record: what opened or closed, its evidence, and the policy."""
    return {"schema": "attention-incident/1", "change": change, **summary, "at": now, "policy": policy_fields()}


def anomaly_record(trace: dict[str, Any], anomaly: Anomaly, outcome: str | None, now: float,
                   evidence: dict[str, Any] | None = None,
                   layer_outcomes: dict[str, int] | None = None, *,
                   reference_outcomes: dict[str, Any] | None = None,
                   outcome_label: str | None = None, outcome_score: float | None = None) -> dict[str, Any]:
    """The JSON anomaly record: identity, finding, outcome (with the label and score it
    was given), the trace beside its reference (``evidence``), the layer's outcome
    tallies so far (``layer_outcomes``) and, for a revision judged by another one, that
    revision's on the same layer (``reference_outcomes``, with its ``revision``), so the
    triage page can compare failure rates; and the two policy sentences."""
    return {
        "schema": "attention-anomaly/1",
        **trace,
        "kind": anomaly.kind,
        "heads": list(anomaly.heads),
        "value": anomaly.value,
        "reference": anomaly.reference,
        "reference_revision": anomaly.reference_revision,
        "effect_size": anomaly.effect,
        "score": anomaly.score,
        "pages": anomaly.pages,
        "measured_on": measured_on(trace.get("rows"), anomaly.kind),
        "outcome": outcome,
        "outcome_label": outcome_label,
        "outcome_score": outcome_score,
        "detected_at": now,
        "evidence": evidence,
        "layer_outcomes": None if layer_outcomes is None else dict(layer_outcomes),
        "reference_outcomes": None if reference_outcomes is None else dict(reference_outcomes),
        "policy": policy_fields(),
    }


def outcome_record(late: dict[str, Any], reference_revision: str, layers: list[dict[str, Any]],
                   now: float) -> dict[str, Any]:
    """The JSON record of an outcome that came after its request's join window
    (``docs/wire-format.md``): the request (``late``: its id, model, revision, layers, the
    outcome with its label, score and time, the time of its first trace and where the
    outcome was read), the revision whose reference judges it, each of its layers with
    the kinds of its findings and the tallies after this outcome (``layers``), and how
    late it came."""
    given, traced = float(late.get("outcome_at") or now), float(late.get("trace_at") or 0.0)
    return {
        "schema": "attention-outcome/1",
        "request_id": late["request_id"],
        "model_id": late["model_id"],
        "model_revision": late["model_revision"],
        "reference_revision": reference_revision,
        "outcome": late["outcome"],
        "label": late.get("outcome_label"),
        "score": late.get("outcome_score"),
        "given_at": given,
        "trace_timestamp": traced,
        "late_by_s": given - traced if traced else None,
        "layers": layers,
        "at": now,
        "source": late["source"],
    }


def measured_on(rows: Any, kind: str) -> str | None:
    """The rows a finding's metric was taken over: ``prompt`` when only rows that see
    nothing but the input (a generation trace's prompt rows, or every row of a trace
    without decoding rows), ``decoding`` when rows of generated tokens are among them
    (they see what the whole model generated, so a fault in any layer moves them); None
    when the trace's rows are not known. The measurer takes the classic metrics over a
    generation trace's prompt rows, its prompt mass over its decoding rows and its learned
    sink mass over every row (``monitor.measuring.measurer``)."""
    if not isinstance(rows, dict):
        return None
    prompt, decoding = int(rows.get("prompt") or 0), int(rows.get("decoding") or 0)
    if not prompt and not decoding:
        return None
    if kind == "prompt_mass_shift" or (kind == "learned_sink_shift" and decoding):
        return "decoding"
    return "prompt" if prompt else "decoding"


def _rounded(values: Any) -> Any:
    """An array as JSON lists rounded to 5 decimals (NaN: null)."""
    array = np.asarray(values, dtype=np.float64)
    return [_rounded(row) for row in array] if array.ndim > 1 else [
        None if not math.isfinite(v) else round(float(v), 5) for v in array]


def evidence_fields(evidence: Evidence | None) -> dict[str, Any] | None:
    """An :class:`Evidence` as the JSON the anomaly record carries (docs/wire-format.md)."""
    if evidence is None:
        return None
    return {
        "heads": list(evidence.heads),
        "key_count": evidence.key_count,
        "similarity": _rounded(evidence.similarity),
        "reference_similarity": None if evidence.reference_similarity is None
        else _rounded(evidence.reference_similarity),
        "metrics": {m: _rounded(v) for m, v in evidence.metrics.items()},
        "band": {m: {"mean": _rounded(evidence.band_mean[m]), "sd": _rounded(evidence.band_sd[m])}
                 for m in evidence.metrics},
        "diversity": dict(zip(("value", "mean", "sd"), (round(v, 5) for v in evidence.diversity), strict=True)),
    }
