"""The routing audit's inputs: a declared contract and frozen evidence, and their
documented JSON form (see ``docs/routing-audit.md``).

Parsing checks *form* only (types, presence, rectangular arrays) and raises
:class:`AuditInputError` naming the field; whether the evidence honours the contract
is the audit's job, reported as reasons, never raised.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from monitor.routing.attention import MaskKind


class AuditInputError(ValueError):
    """A contract or evidence document is malformed; the message names the field."""


@dataclass(frozen=True)
class HeadSpec:
    head_id: str
    kv_group: str


@dataclass(frozen=True)
class RoutingContract:
    """What one attention layer is declared to be."""

    model_id: str
    model_revision: str
    layer: int
    layer_revision: str
    d_model: int
    d_k: int
    d_v: int
    heads: tuple[HeadSpec, ...]
    mask: str
    scale: float
    input_bounds: tuple[float, float]
    operation_budget: int
    parameter_versions: Mapping[str, str]

    def canonical(self) -> dict[str, Any]:
        return {
            "schema": "multi-head-contract/1",
            "model_id": self.model_id,
            "model_revision": self.model_revision,
            "layer": self.layer,
            "layer_revision": self.layer_revision,
            "d_model": self.d_model,
            "d_k": self.d_k,
            "d_v": self.d_v,
            "heads": [{"id": h.head_id, "kv_group": h.kv_group} for h in self.heads],
            "mask": self.mask,
            "scale": self.scale,
            "input_bounds": list(self.input_bounds),
            "operation_budget": self.operation_budget,
            "parameter_versions": dict(self.parameter_versions),
        }


@dataclass(frozen=True)
class Parameter:
    """A parameter matrix bound to the version it was taken from."""

    version: str
    values: NDArray[np.float64]


@dataclass(frozen=True)
class RoutingEvidence:
    """Frozen records of one layer's parameters, inputs and declared semantics."""

    model_revision: str
    layer_revision: str
    head_order: tuple[str, ...]
    queries: Mapping[str, Parameter]  #: head id -> W_q [d_model, d_k]
    keys: Mapping[str, Parameter]  #: KV group -> W_k [d_model, d_k]
    values: Mapping[str, Parameter]  #: KV group -> W_v [d_model, d_v]
    output: Parameter  #: W_o [H·d_v, d_model]
    applied_mask: str
    applied_scale: float
    tokens: NDArray[np.float64]  #: [T, d_model]
    padding: NDArray[np.bool_] | None  #: [T], True for real tokens
    provenance: Mapping[str, str]
    scope: Mapping[str, str]

    @property
    def mask_kind(self) -> MaskKind:
        return "causal" if self.applied_mask == "causal" else "bidirectional"


def contract_from_mapping(doc: Mapping[str, Any]) -> RoutingContract:
    heads = _list(doc, "heads")
    specs = []
    for i, head in enumerate(heads):
        if not isinstance(head, Mapping):
            raise AuditInputError(f"heads[{i}] must be an object with id and kv_group")
        specs.append(HeadSpec(_str(head, "id", f"heads[{i}]."), _str(head, "kv_group", f"heads[{i}].")))
    bounds = _list(doc, "input_bounds")
    if len(bounds) != 2 or not all(_is_number(b) for b in bounds):
        raise AuditInputError("input_bounds must be [low, high]")
    versions = doc.get("parameter_versions")
    if not isinstance(versions, Mapping) or not all(isinstance(v, str) for v in versions.values()):
        raise AuditInputError("parameter_versions must map parameter names to version strings")
    return RoutingContract(
        model_id=_str(doc, "model_id"),
        model_revision=_str(doc, "model_revision", allow_empty=True),
        layer=_int(doc, "layer"),
        layer_revision=_str(doc, "layer_revision", allow_empty=True),
        d_model=_int(doc, "d_model"),
        d_k=_int(doc, "d_k"),
        d_v=_int(doc, "d_v"),
        heads=tuple(specs),
        mask=_str(doc, "mask", allow_empty=True),
        scale=_float(doc, "scale"),
        input_bounds=(float(bounds[0]), float(bounds[1])),
        operation_budget=_int(doc, "operation_budget"),
        parameter_versions=dict(versions),
    )


def evidence_from_mapping(doc: Mapping[str, Any]) -> RoutingEvidence:
    heads = _list(doc, "heads")
    queries: dict[str, Parameter] = {}
    order = []
    for i, head in enumerate(heads):
        if not isinstance(head, Mapping):
            raise AuditInputError(f"heads[{i}] must be an object with id and q")
        head_id = _str(head, "id", f"heads[{i}].")
        order.append(head_id)
        queries.setdefault(head_id, _parameter(head, "q", f"heads[{i}]."))
    keys: dict[str, Parameter] = {}
    values: dict[str, Parameter] = {}
    for i, group in enumerate(_list(doc, "kv_groups")):
        if not isinstance(group, Mapping):
            raise AuditInputError(f"kv_groups[{i}] must be an object with group, k and v")
        name = _str(group, "group", f"kv_groups[{i}].")
        keys[name] = _parameter(group, "k", f"kv_groups[{i}].")
        values[name] = _parameter(group, "v", f"kv_groups[{i}].")
    applied = doc.get("applied")
    if not isinstance(applied, Mapping):
        raise AuditInputError("applied must be an object with mask and scale")
    inputs = doc.get("inputs")
    if not isinstance(inputs, Mapping):
        raise AuditInputError("inputs must be an object with tokens (and optional padding)")
    padding = inputs.get("padding")
    return RoutingEvidence(
        model_revision=_str(doc, "model_revision", allow_empty=True),
        layer_revision=_str(doc, "layer_revision", allow_empty=True),
        head_order=tuple(order),
        queries=queries,
        keys=keys,
        values=values,
        output=_parameter(doc, "output", ""),
        applied_mask=_str(applied, "mask", "applied.", allow_empty=True),
        applied_scale=_float(applied, "scale", "applied."),
        tokens=_matrix(inputs.get("tokens"), "inputs.tokens"),
        padding=None if padding is None else _bool_vector(padding, "inputs.padding"),
        provenance=_str_map(doc, "provenance"),
        scope=_str_map(doc, "scope"),
    )


# --- field readers -------------------------------------------------------------------


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _str(doc: Mapping[str, Any], key: str, where: str = "", allow_empty: bool = False) -> str:
    value = doc.get(key, "" if allow_empty else None)
    if not isinstance(value, str) or (not value and not allow_empty):
        raise AuditInputError(f"{where}{key} must be a non-empty string")
    return value


def _int(doc: Mapping[str, Any], key: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise AuditInputError(f"{key} must be an integer")
    return value


def _float(doc: Mapping[str, Any], key: str, where: str = "") -> float:
    value = doc.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise AuditInputError(f"{where}{key} must be a number")
    return float(value)


def _list(doc: Mapping[str, Any], key: str) -> list[Any]:
    value = doc.get(key)
    if not isinstance(value, list):
        raise AuditInputError(f"{key} must be a list")
    return value


def _str_map(doc: Mapping[str, Any], key: str) -> dict[str, str]:
    value = doc.get(key, {})
    if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
        raise AuditInputError(f"{key} must map names to strings")
    return dict(value)


def _matrix(value: Any, where: str) -> NDArray[np.float64]:
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise AuditInputError(f"{where} must be a rectangular matrix of numbers") from exc
    if array.ndim != 2:
        raise AuditInputError(f"{where} must be a matrix, got {array.ndim} dimensions")
    return array


def _bool_vector(value: Any, where: str) -> NDArray[np.bool_]:
    if not isinstance(value, list) or not all(isinstance(v, bool) for v in value):
        raise AuditInputError(f"{where} must be a list of booleans")
    return np.asarray(value, dtype=bool)


def _parameter(doc: Mapping[str, Any], key: str, where: str) -> Parameter:
    value = doc.get(key)
    if not isinstance(value, Mapping):
        raise AuditInputError(f"{where}{key} must be an object with version and values")
    return Parameter(_str(value, "version", f"{where}{key}.", allow_empty=True),
                     _matrix(value.get("values"), f"{where}{key}.values"))
