"""The routing reference and its audit."""

from __future__ import annotations

import copy
import math
import subprocess
import sys

import numpy as np
import pytest

from monitor.routing.attention import multi_head_attention, operation_count
from monitor.routing.audit import audit_multi_head_routing
from monitor.routing.example import example_contract, example_evidence
from monitor.routing.inputs import AuditInputError, contract_from_mapping, evidence_from_mapping


def plain_attention(x, wq, wk, wv, wo, causal, scale, padding=None):
    """Loops over heads, queries and keys; no numpy linear algebra."""
    t, d_model = len(x), len(x[0])
    concat = [[] for _ in range(t)]
    for q_m, k_m, v_m in zip(wq, wk, wv, strict=True):
        def proj(row, m):
            return [sum(row[a] * m[a][b] for a in range(len(row))) for b in range(len(m[0]))]
        q = [proj(x[i], q_m) for i in range(t)]
        k = [proj(x[i], k_m) for i in range(t)]
        v = [proj(x[i], v_m) for i in range(t)]
        for i in range(t):
            keys = [j for j in range(t) if (not causal or j <= i) and (padding is None or padding[j])]
            out = [0.0] * len(v[0])
            if keys:
                scores = {j: scale * sum(qa * ka for qa, ka in zip(q[i], k[j], strict=True)) for j in keys}
                top = max(scores.values())
                e = {j: math.exp(s - top) for j, s in scores.items()}
                z = sum(e.values())
                out = [sum(e[j] / z * v[j][c] for j in keys) for c in range(len(v[0]))]
            concat[i].extend(out)
    combined = [[sum(concat[i][a] * wo[a][b] for a in range(len(wo))) for b in range(d_model)] for i in range(t)]
    return combined


@pytest.mark.parametrize("groups", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_a_plain_implementation(groups, causal):
    rng = np.random.default_rng(groups)
    t, d_model, h, d_k, d_v = 5, 6, 4, 3, 2  # d_k, d_v != d_model / h
    x = rng.normal(size=(t, d_model))
    wq = [rng.normal(size=(d_model, d_k)) for _ in range(h)]
    kv = [(rng.normal(size=(d_model, d_k)), rng.normal(size=(d_model, d_v))) for _ in range(groups)]
    group_of = [i * groups // h for i in range(h)]
    wk, wv = [kv[g][0] for g in group_of], [kv[g][1] for g in group_of]
    wo = rng.normal(size=(h * d_v, d_model))
    padding = np.array([True, True, True, False, True])
    result = multi_head_attention(x, wq, wk, wv, wo, mask="causal" if causal else "bidirectional",
                                  scale=0.7, padding=padding)
    want = plain_attention(x.tolist(), [m.tolist() for m in wq], [m.tolist() for m in wk],
                           [m.tolist() for m in wv], wo.tolist(), causal, 0.7, padding.tolist())
    np.testing.assert_allclose(result.combined, want, atol=1e-12)
    np.testing.assert_allclose(result.output, x + np.array(want), atol=1e-12)
    # Head h owns columns [h*d_v, (h+1)*d_v) of the concatenation.
    np.testing.assert_allclose(result.combined, sum(result.head_outputs[i] @ wo[i * d_v:(i + 1) * d_v]
                                                    for i in range(h)), atol=1e-12)
    np.testing.assert_allclose(result.weights[:, :, 3], 0.0)  # the padded key gets nothing


def audit(contract=None, evidence=None):
    return audit_multi_head_routing(contract_from_mapping(contract or example_contract()),
                                    evidence_from_mapping(evidence or example_evidence()))


def test_example_passes_with_the_documented_output():
    report = audit()
    assert report.decision == "PASS", report.reasons
    np.testing.assert_allclose(report.combined_output[0], [1 / (1 + math.exp(-1)), 0.5], atol=1e-12)
    assert report.contract_content_id.startswith("multi-head-contract@sha256:")
    assert report.projection_content_id.startswith("multi-head-projections@sha256:")
    assert report.material_evidence_id.startswith("multi-head-material@sha256:")
    assert [h.head_id for h in report.heads] == ["head-0", "head-1"]
    assert all(h.output_id.startswith("multi-head-head-output@sha256:") for h in report.heads)
    assert report.specialization_conclusion == "NOT_ESTABLISHED_FROM_HEAD_EXISTENCE"
    assert report.required_specialization_evidence == "TASK_METRICS_PLUS_CONTROLLED_HEAD_ABLATION"
    assert report.operation_count == operation_count(2, 2, 1, 1, 2, 2)


def test_swapping_two_heads_parameters_changes_the_projection_identity():
    evidence = example_evidence()
    swapped = copy.deepcopy(evidence)
    swapped["heads"][0]["q"], swapped["heads"][1]["q"] = evidence["heads"][1]["q"], evidence["heads"][0]["q"]
    a, b = audit(evidence=evidence), audit(evidence=swapped)
    assert b.decision == "PASS"  # same shapes and versions: only the identity tells them apart
    assert a.projection_content_id != b.projection_content_id
    assert a.material_evidence_id != b.material_evidence_id


def test_a_version_binding_that_does_not_match_fails_and_stale_versions_are_named():
    contract = example_contract()
    contract["parameter_versions"]["q/head-1"] = "v2"
    report = audit(contract=contract)
    assert report.decision == "FAIL"
    assert any("q/head-1 is at version v1, the contract binds v2 (stale)" in r for r in report.reasons)
    evidence = example_evidence()
    evidence["output"]["version"] = ""
    assert any("o carries no version" in r for r in audit(evidence=evidence).reasons)


@pytest.mark.parametrize("change", ["value", "version", "order", "mask", "scale"])
def test_identities_change_with_any_parameter_version_order_mask_or_scale(change):
    contract, evidence = example_contract(), example_evidence()
    if change == "value":
        evidence["kv_groups"][1]["v"]["values"][0][0] = 0.5
    elif change == "version":
        evidence["output"]["version"] = contract["parameter_versions"]["o"] = "v9"
    elif change == "order":
        contract["heads"].reverse()
        evidence["heads"].reverse()
    elif change == "mask":
        contract["mask"] = evidence["applied"]["mask"] = "causal"
    else:
        contract["scale"] = evidence["applied"]["scale"] = 0.5
    base, changed = audit(), audit(contract, evidence)
    assert changed.decision == "PASS", changed.reasons
    assert base.material_evidence_id != changed.material_evidence_id
    if change in ("value", "version", "order"):
        assert base.projection_content_id != changed.projection_content_id
    if change in ("version", "order", "mask", "scale"):
        assert base.contract_content_id != changed.contract_content_id


def test_misdeclared_mask_or_scale_fails():
    evidence = example_evidence()
    evidence["applied"]["mask"] = "causal"
    assert any("applied mask 'causal'" in r for r in audit(evidence=evidence).reasons)
    evidence = example_evidence()
    evidence["applied"]["scale"] = 0.5
    assert any("applied scale 0.5" in r for r in audit(evidence=evidence).reasons)
    contract = example_contract()
    contract["mask"] = evidence["applied"]["mask"] = "sliding"
    assert audit(contract=contract).decision == "FAIL"


def test_out_of_bound_or_non_finite_inputs_fail():
    evidence = example_evidence()
    evidence["inputs"]["tokens"][1][1] = 3.0
    report = audit(evidence=evidence)
    assert report.decision == "FAIL" and any("outside the declared [-1, 1]" in r for r in report.reasons)
    evidence["inputs"]["tokens"][1][1] = float("nan")
    report = audit(evidence=evidence)
    assert report.decision == "FAIL" and report.input_content_id is None and report.combined_output is None


@pytest.mark.parametrize("groups", [1, 2])
def test_gqa_and_mqa_shapes(groups):
    rng = np.random.default_rng(0)
    h, d_model, d_k, d_v, t = 4, 3, 2, 5, 3
    names = [f"head-{i}" for i in range(h)]
    group_of = [f"g{i * groups // h}" for i in range(h)]
    versions = {f"q/{n}": "v1" for n in names} | {f"{p}/g{g}": "v1" for g in range(groups) for p in "kv"}
    contract = {
        "model_id": "m", "model_revision": "r", "layer": 3, "layer_revision": "lr", "d_model": d_model,
        "d_k": d_k, "d_v": d_v, "heads": [{"id": n, "kv_group": g} for n, g in zip(names, group_of, strict=True)],
        "mask": "causal", "scale": 1 / math.sqrt(d_k), "input_bounds": [-10, 10], "operation_budget": 10**6,
        "parameter_versions": versions | {"o": "v1"},
    }
    evidence = {
        "model_revision": "r", "layer_revision": "lr",
        "heads": [{"id": n, "q": {"version": "v1", "values": rng.normal(size=(d_model, d_k)).tolist()}} for n in names],
        "kv_groups": [{"group": f"g{g}", "k": {"version": "v1", "values": rng.normal(size=(d_model, d_k)).tolist()},
                       "v": {"version": "v1", "values": rng.normal(size=(d_model, d_v)).tolist()}}
                      for g in range(groups)],
        "output": {"version": "v1", "values": rng.normal(size=(h * d_v, d_model)).tolist()},
        "applied": {"mask": "causal", "scale": 1 / math.sqrt(d_k)},
        "inputs": {"tokens": rng.uniform(-1, 1, size=(t, d_model)).tolist()},
        "provenance": {"source": "test"}, "scope": {"tenant": "t"},
    }
    assert audit(contract, evidence).decision == "PASS"
    evidence["kv_groups"][0]["v"]["values"] = rng.normal(size=(d_model, d_v + 1)).tolist()
    report = audit(contract, evidence)
    assert report.decision == "FAIL" and any("W_v of group g0 is [3, 6], expected [3, 5]" in r for r in report.reasons)


def test_structural_faults_are_reasons_not_crashes():
    evidence = example_evidence()
    evidence["heads"][1]["id"] = "head-0"
    assert any("not unique" in r for r in audit(evidence=evidence).reasons)
    contract = example_contract()
    contract["operation_budget"] = 10
    assert any("exceeds the declared budget 10" in r for r in audit(contract=contract).reasons)
    contract = example_contract()
    contract["model_revision"] = ""
    evidence = example_evidence()
    evidence["provenance"] = {}
    evidence["scope"] = {}
    reasons = audit(contract, evidence).reasons
    assert "contract model_revision is missing" in reasons
    assert "evidence provenance is missing" in reasons and "evidence scope is missing" in reasons


def test_malformed_documents_raise_naming_the_field():
    evidence = example_evidence()
    evidence["kv_groups"][0]["k"]["values"] = [[1.0], [0.0, 1.0]]
    with pytest.raises(AuditInputError, match=r"kv_groups\[0\]\.k\.values"):
        evidence_from_mapping(evidence)
    contract = example_contract()
    del contract["d_k"]
    with pytest.raises(AuditInputError, match="d_k"):
        contract_from_mapping(contract)


def test_identities_are_equal_across_processes():
    code = ("from monitor.routing.audit import audit_multi_head_routing as a;"
            "from monitor.routing.inputs import contract_from_mapping as c, evidence_from_mapping as e;"
            "from monitor.routing.example import example_contract as x, example_evidence as y;"
            "r = a(c(x()), e(y())); print(r.contract_content_id, r.projection_content_id, r.material_evidence_id,"
            " *[h.output_id for h in r.heads])")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout for seed in ("1", "2")]
    report = audit()
    here = " ".join([report.contract_content_id, report.projection_content_id, report.material_evidence_id,
                     *[h.output_id for h in report.heads]])
    assert runs[0] == runs[1] == here + "\n"
