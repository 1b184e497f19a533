"""Realistic traffic of a causal language model, healthy or faulty, for tests, the
detection evaluation and ``attention-monitor produce --scenario``.

What real traffic looks like, and the synthetic roles of :mod:`monitor.tools.synthetic`
do not: most requests are short (80 % of 6–16 tokens, 15 % of 17–64, 5 % of 65–256), and
the tap samples query rows anywhere in them, so many rows see only a few keys and heads
look alike there; head similarity falls with length. Each head has a role, fixed by the
model id (so healthy and faulty revisions of a model share them), with a strength and
noise of its own:

- ``previous``: near one-hot on the previous token;
- ``sink``: most weight on the first token (healthy: attention sinks are common);
- ``local``: weight decaying with distance;
- ``content``: peaked on one earlier token that depends on the request;
- ``broad``: spread over the visible context.

Faults of a revision: ``collapse`` moves a group of heads of one layer towards one shared
pattern that no healthy head has (low head diversity); ``sink`` turns one head into an
attention sink.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from monitor.protocol.model_contract import LayerContract, ModelContract
from monitor.protocol.schema import Scope, TraceHeader

ROLES = ("previous", "sink", "local", "content", "broad")


@dataclass(frozen=True)
class Fault:
    kind: Literal["collapse", "sink"]
    layer: int
    heads: tuple[int, ...]
    strength: float = 0.9  #: 0 healthy … 1 fully collapsed / fully sunk


@dataclass(frozen=True)
class Scenario:
    """One model revision serving requests."""

    model_id: str = "scenario-lm"
    revision: str = "rev-healthy"
    layers: int = 4
    heads: int = 8
    kv_groups: int = 2
    head_dim: int = 64
    rows: int = 4
    faults: tuple[Fault, ...] = ()
    scope: Scope = field(default_factory=lambda: Scope(tenant="demo", data_class="synthetic"))

    def contract(self) -> ModelContract:
        per_group = self.heads // self.kv_groups
        return ModelContract(
            model_id=self.model_id, model_revision=self.revision, mask="causal", scale=self.head_dim**-0.5,
            layers=tuple(LayerContract(layer=n, d_model=self.heads * self.head_dim, head_dim=self.head_dim,
                                       value_dim=self.head_dim, heads=tuple(f"head-{h}" for h in range(self.heads)),
                                       kv_groups=tuple(h // per_group for h in range(self.heads)))
                         for n in range(self.layers)))

    def roles(self, layer: int) -> list[tuple[str, float]]:
        """Role and strength of each head of ``layer``: the same for every revision of the model."""
        rng = np.random.default_rng([layer, *self.model_id.encode()])
        picked = [ROLES[(layer + h) % len(ROLES)] for h in range(self.heads)]
        return [(role, float(rng.uniform(0.7, 1.3))) for role in picked]

    def request(self, rng: np.random.Generator, request_id: str | None = None,
                timestamp: float = 0.0) -> list[tuple[TraceHeader, NDArray[np.float16]]]:
        """The traces of one request: one per layer, over the same tokens and rows."""
        request_id = request_id or uuid.uuid4().hex
        keys = request_length(rng)
        positions = np.sort(rng.choice(keys, size=min(self.rows, keys), replace=False))
        content = rng.integers(0, np.maximum(positions, 1))  # each row's content token, shared by the layers
        contract = self.contract()
        out = []
        for layer in range(self.layers):
            weights = self.weights(rng, layer, positions, keys, content)
            spec = contract.layers[layer]
            header = TraceHeader(
                trace_id=f"{request_id}/{layer}", request_id=request_id, model_id=self.model_id,
                model_revision=self.revision, contract_id=contract.contract_id, layer=layer, heads=spec.heads,
                kv_groups=spec.kv_groups, query_positions=tuple(int(p) for p in positions), key_count=keys,
                mask="causal", scale=contract.scale, dtype="float16", sample_rate=0.01, scope=self.scope,
                producer_id="scenario", timestamp=timestamp)
            out.append((header, weights))
        return out

    def weights(self, rng: np.random.Generator, layer: int, positions: NDArray[np.int64], keys: int,
                content: NDArray[np.int64]) -> NDArray[np.float16]:
        """``[heads, rows, keys]`` causal softmax weights of one layer."""
        k = np.arange(keys)[None, :]
        p = positions[:, None]
        logits = np.stack([_logits(rng, role, strength, p, k, content) for role, strength in self.roles(layer)])
        for fault in self.faults:
            if fault.layer != layer:
                continue
            heads = list(fault.heads)
            if fault.kind == "collapse":
                shared = _logits(rng, "skip", 1.0, p, k, content)  # a pattern no healthy head has
                logits[heads] = (1 - fault.strength) * logits[heads] + fault.strength * shared[None]
            else:
                sunk = _logits(rng, "sink", 1.6, p, k, content)
                logits[heads] = (1 - fault.strength) * logits[heads] + fault.strength * sunk[None]
        visible = k <= p
        logits = np.where(visible[None], logits, -np.inf)
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        weights: NDArray[np.float16] = (e / e.sum(axis=-1, keepdims=True)).astype(np.float16)
        return weights


def request_length(rng: np.random.Generator) -> int:
    """Tokens of one request: 80 % of 6–16, 15 % of 17–64, 5 % of 65–256."""
    u = rng.random()
    if u < 0.80:
        return int(rng.integers(6, 17))
    if u < 0.95:
        return int(rng.integers(17, 65))
    return int(rng.integers(65, 257))


def _logits(rng: np.random.Generator, role: str, strength: float, p: NDArray[np.int64], k: NDArray[np.int64],
            content: NDArray[np.int64]) -> NDArray[np.float64]:
    noise: NDArray[np.float64] = rng.normal(0.0, 0.5, size=(p.shape[0], k.shape[1]))
    if role == "previous":
        base = np.where(k == np.maximum(p - 1, 0), 8.0, 0.0)
    elif role == "sink":
        base = np.where(k == 0, 5.0, 0.0)
    elif role == "local":
        base = -0.9 * np.abs(p - k).astype(np.float64)
    elif role == "content":
        base = np.where(k == content[:, None], 6.0, 0.0)
    elif role == "skip":
        base = np.where(k == np.maximum(p - 2, 0), 6.0, 0.0)
    else:
        base = np.zeros((p.shape[0], k.shape[1]))
        noise = 0.4 * noise
    return strength * base + noise
