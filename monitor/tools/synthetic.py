"""Realistic synthetic attention traces, for the demo, the tests and benchmarks.

Each head of a layer gets a *role* that real models show, mixed with a little noise:

- ``local``: most weight on the last few keys before the query (previous-token heads);
- ``sink``: most weight on key 0 (attention sinks — healthy, not a fault);
- ``broad``: weight spread over the whole visible context;
- ``peaked``: near one-hot on one content key (healthy too).

A *collapsed* layer (``collapse > 0``) moves every head towards one shared pattern, the
low-head-diversity failure the monitor exists to catch. Rows are produced by a softmax
over logits with the causal mask applied, so they are exactly what a model emits.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from monitor.protocol.model_contract import LayerContract, ModelContract
from monitor.protocol.schema import Scope, TraceHeader

ROLES = ("local", "sink", "broad", "peaked")


@dataclass(frozen=True)
class SyntheticModel:
    """A model revision whose layers are described by per-head roles."""

    model_id: str
    revision: str
    layers: int = 4
    heads: int = 8
    kv_groups: int = 2
    head_dim: int = 16
    d_model: int = 128

    def contract(self) -> ModelContract:
        per_group = self.heads // self.kv_groups
        return ModelContract(
            model_id=self.model_id,
            model_revision=self.revision,
            mask="causal",
            scale=1.0 / float(np.sqrt(self.head_dim)),
            layers=tuple(
                LayerContract(
                    layer=n, d_model=self.d_model, head_dim=self.head_dim, value_dim=self.head_dim,
                    heads=tuple(f"head-{h}" for h in range(self.heads)),
                    kv_groups=tuple(h // per_group for h in range(self.heads)),
                )
                for n in range(self.layers)
            ),
        )


def head_logits(rng: np.random.Generator, role: str, positions: NDArray[np.int64], keys: int) -> NDArray[np.float64]:
    """Pre-softmax scores ``[rows, keys]`` for one head with ``role``."""
    k = np.arange(keys)[None, :]
    p = positions[:, None]
    noise: NDArray[np.float64] = rng.normal(0.0, 0.6, size=(len(positions), keys))
    if role == "local":
        distance: NDArray[np.float64] = np.abs(p - 1 - k).astype(np.float64)
        return -0.8 * distance + noise
    if role == "sink":
        return np.where(k == 0, 6.0, 0.0) + noise
    if role == "peaked":
        target = rng.integers(0, np.maximum(p, 1))
        return np.where(k == target, 9.0, 0.0) + noise
    return 0.3 * noise  # broad


def trace_weights(
    rng: np.random.Generator,
    roles: list[str],
    positions: NDArray[np.int64],
    keys: int,
    collapse: float = 0.0,
    dtype: type[np.floating] = np.float16,
) -> NDArray[np.floating]:
    """``[heads, rows, keys]`` causal softmax weights; ``collapse`` in [0, 1] blends every
    head's logits towards one shared pattern."""
    logits = np.stack([head_logits(rng, role, positions, keys) for role in roles])
    if collapse > 0:
        shared = head_logits(rng, "local", positions, keys)
        logits = (1 - collapse) * logits + collapse * shared[None]
    visible = np.arange(keys)[None, :] <= positions[:, None]
    logits = np.where(visible[None], logits, -np.inf)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights: NDArray[np.floating] = (e / e.sum(axis=-1, keepdims=True)).astype(dtype)
    return weights


def layer_roles(layer: int, heads: int) -> list[str]:
    """A stable mix of roles per layer (deeper layers lean broad, early ones local)."""
    return [ROLES[(layer + h) % len(ROLES)] for h in range(heads)]


def make_header(
    contract: ModelContract,
    layer: int,
    positions: NDArray[np.int64],
    keys: int,
    *,
    request_id: str | None = None,
    dtype: str = "float16",
    scope: Scope | None = None,
    producer_id: str = "synthetic",
    timestamp: float = 0.0,
) -> TraceHeader:
    spec = contract.layer(layer)
    if spec is None:
        raise ValueError(f"layer {layer} is not in the contract")
    return TraceHeader(
        trace_id=uuid.uuid4().hex,
        request_id=request_id or uuid.uuid4().hex,
        model_id=contract.model_id,
        model_revision=contract.model_revision,
        contract_id=contract.contract_id,
        layer=layer,
        heads=spec.heads,
        kv_groups=spec.kv_groups,
        query_positions=tuple(int(p) for p in positions),
        key_count=keys,
        mask=contract.mask,
        scale=contract.scale,
        dtype=dtype,
        sample_rate=0.01,
        scope=scope or Scope(tenant="demo", data_class="synthetic"),
        producer_id=producer_id,
        timestamp=timestamp,
    )


def sample_positions(rng: np.random.Generator, keys: int, rows: int) -> NDArray[np.int64]:
    """``rows`` distinct query positions, the last token always among them."""
    rows = min(rows, keys)
    others = rng.choice(keys - 1, size=rows - 1, replace=False) if rows > 1 else np.empty(0, np.int64)
    return np.sort(np.append(others, keys - 1)).astype(np.int64)
