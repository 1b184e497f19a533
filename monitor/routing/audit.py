"""The routing audit: evidence of one attention layer checked against its contract,
every piece named by its content identity (:mod:`monitor.core.identity`).

The report never concludes that a head is specialised: head existence does not
establish specialization, which needs task metrics plus controlled head ablation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from monitor.core.identity import content_id, quantized
from monitor.routing.attention import MASK_KINDS, AttentionResult, multi_head_attention, operation_count
from monitor.routing.inputs import Parameter, RoutingContract, RoutingEvidence

SPECIALIZATION_CONCLUSION = "NOT_ESTABLISHED_FROM_HEAD_EXISTENCE"
REQUIRED_SPECIALIZATION_EVIDENCE = "TASK_METRICS_PLUS_CONTROLLED_HEAD_ABLATION"


@dataclass(frozen=True)
class HeadOutput:
    head_id: str
    output_id: str | None  #: None when the layer could not be run


@dataclass(frozen=True)
class AuditReport:
    contract_content_id: str
    projection_content_id: str | None  #: None when a parameter is not finite
    input_content_id: str | None  #: None when an input is not finite
    heads: tuple[HeadOutput, ...]
    combined_output: NDArray[np.float64] | None  #: ``[T, d_model]`` before the residual
    output: NDArray[np.float64] | None  #: ``[T, d_model]`` after the residual
    operation_count: int | None
    specialization_conclusion: str
    required_specialization_evidence: str
    material_evidence_id: str
    decision: str  #: "PASS" or "FAIL"
    reasons: tuple[str, ...]  #: why it failed; empty on PASS


def audit_multi_head_routing(contract: RoutingContract, evidence: RoutingEvidence) -> AuditReport:
    """Validate ``evidence`` against ``contract``, run the reference routing when the
    shapes allow it, and name everything by content."""
    reasons = _form_reasons(contract, evidence)
    shape_reasons = _shape_reasons(contract, evidence)
    reasons += shape_reasons
    contract_id = content_id("multi-head-contract", contract.canonical())
    projection_id = _projection_id(contract, evidence)
    input_id = _input_id(evidence)
    ops = None
    result: AttentionResult | None = None
    if not shape_reasons:
        t = evidence.tokens.shape[0]
        groups = len({h.kv_group for h in contract.heads})
        ops = operation_count(t, contract.d_model, contract.d_k, contract.d_v, len(contract.heads), groups)
        if ops > contract.operation_budget:
            reasons.append(f"operation count {ops} exceeds the declared budget {contract.operation_budget}")
        if projection_id is not None and input_id is not None:
            result = _run(contract, evidence)
    heads = _head_outputs(contract, result, contract_id, projection_id, input_id)
    decision = "FAIL" if reasons else "PASS"
    material = content_id("multi-head-material", {
        "contract": contract_id,
        "projections": projection_id,
        "input": input_id,
        "heads": [{"id": h.head_id, "output": h.output_id} for h in heads],
        "combined_output": None if result is None else quantized(result.combined),
        "output": None if result is None else quantized(result.output),
        "operation_count": ops,
        "specialization_conclusion": SPECIALIZATION_CONCLUSION,
        "required_specialization_evidence": REQUIRED_SPECIALIZATION_EVIDENCE,
        "decision": decision,
        "reasons": reasons,
    })
    return AuditReport(
        contract_content_id=contract_id,
        projection_content_id=projection_id,
        input_content_id=input_id,
        heads=heads,
        combined_output=None if result is None else result.combined,
        output=None if result is None else result.output,
        operation_count=ops,
        specialization_conclusion=SPECIALIZATION_CONCLUSION,
        required_specialization_evidence=REQUIRED_SPECIALIZATION_EVIDENCE,
        material_evidence_id=material,
        decision=decision,
        reasons=tuple(reasons),
    )


# --- checks --------------------------------------------------------------------------


def _form_reasons(c: RoutingContract, e: RoutingEvidence) -> list[str]:
    reasons = []
    ids = [h.head_id for h in c.heads]
    if not ids:
        reasons.append("the contract declares no heads")
    if len(set(ids)) != len(ids):
        reasons.append(f"contract head ids are not unique: {ids}")
    if len(set(e.head_order)) != len(e.head_order):
        reasons.append(f"evidence head ids are not unique: {list(e.head_order)}")
    if tuple(ids) != e.head_order:
        reasons.append(f"evidence heads {list(e.head_order)} are not the contract's heads in order {ids}")
    for what, value in (("contract model_revision", c.model_revision), ("contract layer_revision", c.layer_revision),
                        ("evidence model_revision", e.model_revision), ("evidence layer_revision", e.layer_revision)):
        if not value:
            reasons.append(f"{what} is missing")
    if c.model_revision and e.model_revision and c.model_revision != e.model_revision:
        reasons.append(f"evidence is of model revision {e.model_revision}, contract of {c.model_revision}")
    if c.layer_revision and e.layer_revision and c.layer_revision != e.layer_revision:
        reasons.append(f"evidence is of layer revision {e.layer_revision}, contract of {c.layer_revision}")
    if c.mask not in MASK_KINDS:
        reasons.append(f"contract mask {c.mask!r} is not declared as one of {list(MASK_KINDS)}")
    if e.applied_mask != c.mask:
        reasons.append(f"evidence applied mask {e.applied_mask!r}, contract declares {c.mask!r}")
    if not (np.isfinite(c.scale) and c.scale > 0):
        reasons.append(f"contract scale {c.scale} is not a positive number")
    if e.applied_scale != c.scale:
        reasons.append(f"evidence applied scale {e.applied_scale}, contract declares {c.scale}")
    if not e.provenance:
        reasons.append("evidence provenance is missing")
    if not e.scope:
        reasons.append("evidence scope is missing")
    reasons += _version_reasons(c, e)
    reasons += _input_reasons(c, e)
    return reasons


def _parameters(e: RoutingEvidence) -> dict[str, Parameter]:
    named = {f"q/{h}": p for h, p in e.queries.items()}
    named.update({f"k/{g}": p for g, p in e.keys.items()})
    named.update({f"v/{g}": p for g, p in e.values.items()})
    named["o"] = e.output
    return named


def _version_reasons(c: RoutingContract, e: RoutingEvidence) -> list[str]:
    reasons = []
    params = _parameters(e)
    for name, param in sorted(params.items()):
        bound = c.parameter_versions.get(name)
        if not param.version:
            reasons.append(f"parameter {name} carries no version")
        elif bound is None:
            reasons.append(f"parameter {name} (version {param.version}) is not bound by the contract")
        elif bound != param.version:
            reasons.append(f"parameter {name} is at version {param.version}, the contract binds {bound} (stale)")
    for name in sorted(set(c.parameter_versions) - set(params)):
        reasons.append(f"the contract binds {name}, which the evidence does not provide")
    return reasons


def _input_reasons(c: RoutingContract, e: RoutingEvidence) -> list[str]:
    low, high = c.input_bounds
    x = e.tokens
    if not np.isfinite(x).all():
        return ["input representations are not all finite"]
    if x.size and (x.min() < low or x.max() > high):
        return [f"input representations span [{x.min():g}, {x.max():g}], outside the declared [{low:g}, {high:g}]"]
    return []


def _shape_reasons(c: RoutingContract, e: RoutingEvidence) -> list[str]:
    reasons = []
    if e.tokens.shape[1:] != (c.d_model,) or e.tokens.shape[0] == 0:
        reasons.append(f"inputs are {list(e.tokens.shape)}, expected [T>0, {c.d_model}]")
    if e.padding is not None and e.padding.shape != e.tokens.shape[:1]:
        reasons.append(f"padding has {e.padding.shape[0]} entries for {e.tokens.shape[0]} tokens")
    groups = {h.kv_group for h in c.heads}
    for head in c.heads:
        q = e.queries.get(head.head_id)
        if q is None:
            reasons.append(f"no query projection for head {head.head_id}")
        elif q.values.shape != (c.d_model, c.d_k):
            reasons.append(f"W_q of {head.head_id} is {list(q.values.shape)}, expected [{c.d_model}, {c.d_k}]")
    for group in sorted(groups):
        for name, table, d in (("W_k", e.keys, c.d_k), ("W_v", e.values, c.d_v)):
            p = table.get(group)
            if p is None:
                reasons.append(f"no {name} for KV group {group}")
            elif p.values.shape != (c.d_model, d):
                reasons.append(f"{name} of group {group} is {list(p.values.shape)}, expected [{c.d_model}, {d}]")
    for group in sorted(set(e.keys) - groups):
        reasons.append(f"evidence has K/V for group {group}, which no declared head uses")
    want_o = (len(c.heads) * c.d_v, c.d_model)
    if e.output.values.shape != want_o:
        reasons.append(f"W_o is {list(e.output.values.shape)}, expected {list(want_o)}")
    return reasons


# --- identities and the run -----------------------------------------------------------


def _param_doc(p: Parameter) -> dict[str, Any]:
    return {"version": p.version, "values": p.values}


def _projection_id(c: RoutingContract, e: RoutingEvidence) -> str | None:
    params = _parameters(e)
    if not all(np.isfinite(p.values).all() for p in params.values()):
        return None
    groups = {h.kv_group for h in c.heads} | set(e.keys)
    return content_id("multi-head-projections", {
        "heads": [
            {"id": h, "q": _param_doc(e.queries[h]) if h in e.queries else None} for h in e.head_order
        ],
        "kv_groups": [
            {"group": g,
             "k": _param_doc(e.keys[g]) if g in e.keys else None,
             "v": _param_doc(e.values[g]) if g in e.values else None}
            for g in sorted(groups)
        ],
        "head_groups": [{"id": h.head_id, "kv_group": h.kv_group} for h in c.heads],
        "output": _param_doc(e.output),
    })


def _input_id(e: RoutingEvidence) -> str | None:
    if not np.isfinite(e.tokens).all():
        return None
    return content_id("multi-head-input", {
        "tokens": e.tokens,
        "padding": e.padding,
        "provenance": dict(e.provenance),
        "scope": dict(e.scope),
    })


def _run(c: RoutingContract, e: RoutingEvidence) -> AttentionResult:
    group_of = {h.head_id: h.kv_group for h in c.heads}
    order = [h.head_id for h in c.heads]
    return multi_head_attention(
        e.tokens,
        [e.queries[h].values for h in order],
        [e.keys[group_of[h]].values for h in order],
        [e.values[group_of[h]].values for h in order],
        e.output.values,
        mask=e.mask_kind,
        scale=e.applied_scale,
        padding=e.padding,
    )


def _head_outputs(
    c: RoutingContract, result: AttentionResult | None, cid: str, pid: str | None, iid: str | None
) -> tuple[HeadOutput, ...]:
    heads = []
    for i, head in enumerate(c.heads):
        oid = None
        if result is not None:
            oid = content_id("multi-head-head-output", {
                "head_id": head.head_id, "contract": cid, "projections": pid, "input": iid,
                "output": quantized(result.head_outputs[i]),
            })
        heads.append(HeadOutput(head.head_id, oid))
    return tuple(heads)


def report_lines(report: AuditReport, token: int = 0) -> list[str]:
    """``key=value`` lines of a report, in the documented order, then one ``reason=``
    line per failure reason."""
    out = report.combined_output
    token_line = "n/a" if out is None or token >= out.shape[0] else ",".join(f"{v:.3f}" for v in out[token])
    lines = [
        f"contract_id={report.contract_content_id}",
        f"projection_id={report.projection_content_id or 'n/a'}",
        f"head_ids={','.join(h.head_id for h in report.heads)}",
        f"token{token}_output={token_line}",
        f"specialization={report.specialization_conclusion}",
        f"required_evidence={report.required_specialization_evidence}",
        f"material_id={report.material_evidence_id}",
        f"decision={report.decision}",
    ]
    return lines + [f"reason={r}" for r in report.reasons]
