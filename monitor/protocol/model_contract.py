"""The model contract: what a model revision's attention layers are.

Traces name it by ``contract_id``, the content identity
``attention-model-contract@sha256:…`` of its canonical serialization (the scheme of
:mod:`monitor.core.identity`, shared with the routing audit). Published on the
compacted topic ``attention-contracts`` keyed by that id, signed by a key the monitor's
keyring allows to publish contracts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections import Counter
from collections.abc import Callable
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from monitor.core.identity import content_id

CONTRACT_KIND = "attention-model-contract"


class LayerContract(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    layer: int = Field(ge=0)
    d_model: int = Field(gt=0)
    head_dim: int = Field(gt=0, description="d_k of every query head")
    value_dim: int = Field(gt=0, description="d_v of every head")
    heads: tuple[str, ...] = Field(min_length=1, description="query head ids in declared order")
    kv_groups: tuple[int, ...] = Field(description="KV group of each query head, in head order")
    window: int | None = Field(None, gt=0, description="sliding window: a causal row at position p sees keys "
                               "p - window + 1 .. p (None: every earlier key)")
    learned_sink: Literal[True] | None = Field(None, description="each head has a learned sink logit in its "
                                               "softmax (gpt-oss): rows carry the sink's mass beside the keys'")

    @model_validator(mode="after")
    def _consistent(self) -> LayerContract:
        if len(set(self.heads)) != len(self.heads):
            raise ValueError(f"layer {self.layer}: head ids are not unique")
        if len(self.kv_groups) != len(self.heads):
            raise ValueError(f"layer {self.layer}: kv_groups needs one group per head ({len(self.heads)})")
        groups = sorted(set(self.kv_groups))
        if groups != list(range(len(groups))):
            raise ValueError(f"layer {self.layer}: kv_groups must be numbered 0..G-1, got {groups}")
        return self

    @property
    def group_count(self) -> int:
        return len(set(self.kv_groups))


class ModelContract(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    model_id: str = Field(min_length=1, max_length=200)
    model_revision: str = Field(min_length=1, max_length=200, description="commit or weights hash; immutable")
    mask: Literal["causal", "bidirectional"]
    scale: float = Field(gt=0, description="the factor applied to q·k before the softmax")
    layers: tuple[LayerContract, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_layers(self) -> ModelContract:
        numbers = [layer.layer for layer in self.layers]
        if len(set(numbers)) != len(numbers):
            raise ValueError("layer numbers are not unique")
        if not math.isfinite(self.scale):
            raise ValueError("scale must be finite")
        return self

    def canonical(self) -> dict[str, Any]:
        """The serialization the content id hashes; optional fields left unset are left
        out, so a contract that does not use them keeps the id it always had."""
        return self.model_dump(mode="json", exclude_none=True)

    @cached_property
    def contract_id(self) -> str:
        return content_id(CONTRACT_KIND, self.canonical())

    def layer(self, number: int) -> LayerContract | None:
        for layer in self.layers:
            if layer.layer == number:
                return layer
        return None


def contract_signature(contract_id: str, secret: bytes) -> str:
    """HMAC-SHA256 (hex) of a contract's content id under a key: the id is recomputed from
    the content, so signing it signs the content."""
    return hmac.new(secret, b"attention-model-contract\0" + contract_id.encode(), hashlib.sha256).hexdigest()


#: (key id, signature, contract id) → why the record is refused, or None to accept it
Verifier = Callable[[str | None, str | None, str], str | None]


class ContractTable:
    """Model contracts by id, fed from the compacted ``attention-contracts`` topic.

    A record's value is ``{"contract_id", "contract", "key_id", "signature"}`` and its key
    the contract id; the id is recomputed from the content and a record whose id does not
    match is refused, as is one the ``verify`` callable refuses (a signature by a key not
    allowed to publish contracts). A tombstone (no value) removes the contract. At most
    ``max_contracts`` are kept: beyond, the oldest goes (counted in ``evicted``).
    """

    def __init__(self, verify: Verifier | None = None, max_contracts: int = 1000):
        self._contracts: dict[str, ModelContract] = {}
        self._verify = verify
        self.max_contracts = max_contracts
        self.refusals: Counter[str] = Counter()
        self.evicted = 0
        self.version = 0  #: changes whenever a contract is added or removed

    @property
    def refused(self) -> int:
        return sum(self.refusals.values())

    def __len__(self) -> int:
        return len(self._contracts)

    def get(self, contract_id: str) -> ModelContract | None:
        return self._contracts.get(contract_id)

    def contracts(self) -> list[ModelContract]:
        return list(self._contracts.values())

    def add(self, contract: ModelContract) -> None:
        self._contracts.pop(contract.contract_id, None)
        self._contracts[contract.contract_id] = contract
        while len(self._contracts) > self.max_contracts:
            del self._contracts[next(iter(self._contracts))]
            self.evicted += 1
        self.version += 1

    def apply(self, key: bytes | None, value: bytes | None) -> str | None:
        """Apply one record; returns the contract id it added or removed, or None if refused."""
        if value is None:
            if key is None:
                self.refusals["malformed"] += 1
                return None
            contract_id = key.decode("utf-8", "replace")
            if self._contracts.pop(contract_id, None) is not None:
                self.version += 1
            return contract_id
        try:
            doc = json.loads(value)
            contract = ModelContract.model_validate(doc.get("contract", doc) if isinstance(doc, dict) else doc)
        except (ValueError, TypeError):
            self.refusals["malformed"] += 1
            return None
        if key is not None and key.decode("utf-8", "replace") != contract.contract_id:
            self.refusals["id_mismatch"] += 1
            return None
        if self._verify is not None:
            key_id, signature = doc.get("key_id"), doc.get("signature")
            why = self._verify(key_id if isinstance(key_id, str) else None,
                               signature if isinstance(signature, str) else None, contract.contract_id)
            if why is not None:
                self.refusals[why] += 1
                return None
        self.add(contract)
        return contract.contract_id

    @staticmethod
    def record(contract: ModelContract, key_id: str | None = None, secret: bytes | None = None) -> tuple[bytes, bytes]:
        """The (key, value) to publish a contract with, signed when a key is given."""
        doc: dict[str, Any] = {"contract_id": contract.contract_id, "contract": contract.canonical()}
        if key_id is not None and secret is not None:
            doc |= {"key_id": key_id, "signature": contract_signature(contract.contract_id, secret)}
        return contract.contract_id.encode(), json.dumps(doc).encode()
