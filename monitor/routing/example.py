"""The documented illustrative audit: two heads with d_k = d_v = 1.

Two tokens ``x = [[1, 0], [0, 1]]``, bidirectional mask, scale 1. Head ``head-0``
projects token 0 to query 1 and keys ``[1, 0]``: its weights for token 0 are
``softmax([1, 0]) = [0.731, 0.269]`` over values ``[1, 0]``, giving 0.731. Head
``head-1`` has a zero query, so it spreads evenly: 0.500. ``W_o`` is the identity, so
token 0's combined output is ``0.731, 0.500``. It is illustrative only: it proves
nothing about any real model, and neither head is thereby "specialised".
"""

from __future__ import annotations

from typing import Any


def example_contract() -> dict[str, Any]:
    return {
        "model_id": "illustrative-two-head",
        "model_revision": "example-rev-1",
        "layer": 0,
        "layer_revision": "example-layer-rev-1",
        "d_model": 2,
        "d_k": 1,
        "d_v": 1,
        "heads": [{"id": "head-0", "kv_group": "kv-0"}, {"id": "head-1", "kv_group": "kv-1"}],
        "mask": "bidirectional",
        "scale": 1.0,
        "input_bounds": [-1.0, 1.0],
        "operation_budget": 1000,
        "parameter_versions": {
            "q/head-0": "v1", "q/head-1": "v1",
            "k/kv-0": "v1", "v/kv-0": "v1", "k/kv-1": "v1", "v/kv-1": "v1",
            "o": "v1",
        },
    }


def example_evidence() -> dict[str, Any]:
    def param(values: list[list[float]]) -> dict[str, Any]:
        return {"version": "v1", "values": values}

    return {
        "model_revision": "example-rev-1",
        "layer_revision": "example-layer-rev-1",
        "heads": [
            {"id": "head-0", "q": param([[1.0], [0.0]])},
            {"id": "head-1", "q": param([[0.0], [0.0]])},
        ],
        "kv_groups": [
            {"group": "kv-0", "k": param([[1.0], [0.0]]), "v": param([[1.0], [0.0]])},
            {"group": "kv-1", "k": param([[1.0], [0.0]]), "v": param([[1.0], [0.0]])},
        ],
        "output": param([[1.0, 0.0], [0.0, 1.0]]),
        "applied": {"mask": "bidirectional", "scale": 1.0},
        "inputs": {"tokens": [[1.0, 0.0], [0.0, 1.0]]},
        "provenance": {"source": "monitor.routing.example", "note": "illustrative only"},
        "scope": {"tenant": "example", "data_class": "synthetic"},
    }
