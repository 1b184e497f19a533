"""Decisions about references: which revision's reference judges a model revision.

A decision is a record on the compacted topic ``attention-references``, keyed by
``model@revision``, written by ``attention-monitor reference promote`` or ``… pin``:

- ``promote``: the revision becomes its own reference (it learns one from its next
  traces) — the only way a pinned revision ever does;
- ``pin``: the revision is judged by ``reference``'s reference and learns none.

Every instance reads the topic in full (like the model contracts) and hands new
decisions to its measurer, which records them in the reference state; the later of two
decisions about a revision holds.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ReferenceDecision(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_id: str = Field(min_length=1, max_length=200)
    revision: str = Field(min_length=1, max_length=200)
    action: Literal["promote", "pin"]
    reference: str | None = Field(None, min_length=1, max_length=200, description="pin: the judging revision")
    at: float = Field(ge=0, description="seconds since the epoch")
    by: str = Field("unknown", max_length=200, description="who decided")

    @model_validator(mode="after")
    def _reference(self) -> ReferenceDecision:
        if (self.action == "pin") != (self.reference is not None):
            raise ValueError("a pin names its reference revision; a promotion names none")
        if self.reference == self.revision:
            raise ValueError("a revision cannot be pinned to itself; promote it instead")
        return self

    @property
    def key(self) -> str:
        return f"{self.model_id}@{self.revision}"

    def record(self) -> tuple[bytes, bytes]:
        """The (key, value) to publish it with."""
        return self.key.encode(), self.model_dump_json().encode()


def parse_target(text: str) -> tuple[str, str]:
    """``MODEL@REVISION`` → (model, revision); the last ``@`` separates them."""
    model, at, revision = text.rpartition("@")
    if not at or not model or not revision:
        raise ValueError(f"{text!r} must be MODEL@REVISION")
    return model, revision


class ReferenceTable:
    """The latest decision per revision, fed from the references topic; ``version``
    counts every decision applied, so a reader can hand on only the new ones."""

    def __init__(self) -> None:
        self.decisions: dict[str, ReferenceDecision] = {}
        self.log: list[ReferenceDecision] = []  #: every decision applied, in order
        self.refused = 0

    @property
    def version(self) -> int:
        return len(self.log)

    def since(self, version: int) -> list[ReferenceDecision]:
        return self.log[version:]

    def apply(self, key: bytes | None, value: bytes | None) -> str | None:
        """Apply one record; returns its key, or None if refused (tombstones are kept
        out: a decision, once made, is only replaced by a later one)."""
        if value is None:
            return None
        try:
            decision = ReferenceDecision.model_validate(json.loads(value))
        except (ValueError, TypeError, ValidationError):
            self.refused += 1
            return None
        if key is not None and key.decode("utf-8", "replace") != decision.key:
            self.refused += 1
            return None
        current = self.decisions.get(decision.key)
        if current is None or decision.at >= current.at:
            self.decisions[decision.key] = decision
            self.log.append(decision)
        return decision.key
