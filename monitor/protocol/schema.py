"""What producers send, as pydantic models: trace headers and task outcomes (see
``docs/wire-format.md``). The model contract, which traces name by id, is
:mod:`monitor.protocol.model_contract`."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["FAILURE_LABELS", "OUTCOMES", "SUCCESS_LABELS", "Scope", "TaskOutcome", "TraceHeader"]

SCHEMA_VERSION: Literal[1] = 1
IDENTIFIER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]*$"
IDENTIFIER_MAX = 128
#: the rule of IDENTIFIER_PATTERN and IDENTIFIER_MAX, as error messages say it
IDENTIFIER_RULE = (f"must be 1-{IDENTIFIER_MAX} characters of A-Z a-z 0-9 . _ : / @ + = -, starting with a letter or "
                   "digit")
#: the words a task outcome may say (a trace whose outcome never came is ``missing``)
OUTCOMES = ("success", "failure")
Outcome = Literal["success", "failure"]
#: labels whose meaning is fixed: an outcome record that gives one of these and no
#: ``outcome`` gets the outcome it implies, and one that contradicts it is refused
FAILURE_LABELS = ("thumbs_down", "regenerate", "abandoned", "escalated")
SUCCESS_LABELS = ("thumbs_up", "accepted")
LABEL_PATTERN = r"^[a-z][a-z0-9_]*$"
LABEL_MAX = 64
Identifier = Field(min_length=1, max_length=IDENTIFIER_MAX, pattern=IDENTIFIER_PATTERN)


def check_identifier(value: str, what: str) -> str:
    """``value`` if it can be a trace or request id; ``ValueError`` naming ``what`` otherwise."""
    if not isinstance(value, str) or not 0 < len(value) <= IDENTIFIER_MAX or not re.match(IDENTIFIER_PATTERN, value):
        raise ValueError(f"{what} {value!r} {IDENTIFIER_RULE}")
    return value


class Scope(BaseModel):
    """Who the traced request belongs to: the access policy decides who may process it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    data_class: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")


class TraceHeader(BaseModel):
    """One request × one layer. Everything but the weights; written as JSON in the
    record's header section (see ``docs/wire-format.md``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = SCHEMA_VERSION
    trace_id: str = Identifier
    request_id: str = Identifier
    model_id: str = Field(min_length=1, max_length=200)
    model_revision: str = Field(min_length=1, max_length=200)
    contract_id: str = Field(min_length=1, max_length=200)
    layer: int = Field(ge=0, le=100_000)
    heads: tuple[str, ...] = Field(min_length=1, description="query head ids in declared order")
    kv_groups: tuple[int, ...] = Field(description="KV group of each query head")
    query_positions: tuple[int, ...] = Field(min_length=1, description="key index of each sampled row's token")
    key_count: int = Field(gt=0)
    mask: Literal["causal", "bidirectional"]
    window: int | None = Field(None, gt=0, description="the layer's sliding window (causal): a row at position p "
                               "sees keys p - window + 1 .. p; the contract's")
    prompt_length: int | None = Field(None, gt=0, description="keys 0 .. prompt_length - 1 are the prompt; rows "
                                      "at positions from prompt_length on are generated tokens (decode steps)")
    learned_sink: bool = Field(False, description="the payload carries, after the weights, each row's mass on the "
                               "layer's learned sink ([heads, rows], same dtype); the contract's")
    padding_side: Literal["left", "right"] = "right"
    padding: int = Field(default=0, ge=0, description="padded key positions on padding_side")
    scale: float = Field(gt=0)
    weights_source: Literal["eager", "fallback", "recomputed"] = Field(
        "eager", description="eager: the model's own weights; recomputed: from its query and key states (a tap "
        "around fused attention); fallback: another path")
    dtype: Literal["float16", "float32"]
    sample_rate: float = Field(gt=0, le=1)
    scope: Scope
    producer_id: str = Field(min_length=1, max_length=128)
    timestamp: float = Field(ge=0, description="seconds since the epoch, when the request ran")

    @field_validator("scale", "timestamp", "sample_rate")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be finite")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TraceHeader:
        if len(self.kv_groups) != len(self.heads):
            raise ValueError("kv_groups needs one group per head")
        if self.padding >= self.key_count:
            raise ValueError("padding leaves no key")
        if any(p < 0 or p >= self.key_count for p in self.query_positions):
            raise ValueError("query_positions must index keys (0 <= position < key_count)")
        if self.window is not None and self.mask != "causal":
            raise ValueError("a sliding window needs the causal mask")
        if self.prompt_length is not None and (self.mask != "causal" or self.prompt_length > self.key_count):
            raise ValueError("prompt_length needs the causal mask and at most key_count keys")
        return self

    @property
    def shape(self) -> tuple[int, int, int]:
        return len(self.heads), len(self.query_positions), self.key_count


class TaskOutcome(BaseModel):
    """How the traced request ended, as the task system saw it (topic ``task-outcomes``,
    JSON, key = request_id; ``docs/wire-format.md``).

    ``outcome`` is what metrics and alerts count: a trace's outcome is a failure exactly
    when its record says ``failure``. ``label`` says how the user or evaluator gave it
    (``thumbs_down``, ``regenerate``, ...; any lower-case word) and ``score`` grades it
    from 0 to 1; both travel with the outcome to the anomaly records and the triage
    page and never change what counts. A record may leave ``outcome`` out when its label
    is one of :data:`FAILURE_LABELS` or :data:`SUCCESS_LABELS`: the label then says it.
    Unknown fields are ignored, so older and newer producers and monitors read each
    other's records."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    request_id: str = Identifier
    outcome: Outcome
    label: str | None = Field(None, min_length=1, max_length=LABEL_MAX, pattern=LABEL_PATTERN)
    score: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    timestamp: float = Field(default=0.0, ge=0, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _outcome_of_label(cls, data: Any) -> Any:
        """A label of fixed meaning says the outcome a record left out."""
        if not isinstance(data, dict) or data.get("outcome") is not None:
            return data
        label = data.get("label")
        implied = label_outcome(label) if isinstance(label, str) else None
        if implied is None:
            raise ValueError("no outcome: give success or failure" + (
                f" (label {label!r} has no fixed meaning)" if isinstance(label, str) else "") +
                f", or a label that implies one ({', '.join((*FAILURE_LABELS, *SUCCESS_LABELS))})")
        return {**data, "outcome": implied}

    @model_validator(mode="after")
    def _label_agrees(self) -> TaskOutcome:
        implied = None if self.label is None else label_outcome(self.label)
        if implied is not None and implied != self.outcome:
            raise ValueError(f"label {self.label!r} means {implied}, but outcome says {self.outcome}")
        return self


def label_outcome(label: str) -> str | None:
    """The outcome a label of fixed meaning implies (None for any other label)."""
    return "failure" if label in FAILURE_LABELS else "success" if label in SUCCESS_LABELS else None
