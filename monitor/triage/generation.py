"""Prompt rows and decoding rows, told apart: what the rows a layer's findings were
measured on say about where a fault starts.

Under autoregressive generation a trace has two kinds of sampled rows. A *prompt* row
sees only the input, so it changes only if this layer or one before it changed. A
*decoding* row attends over the tokens generated so far, which the whole model chose: a
fault in a later layer changes the generated tokens, and with them the decoding rows of
every layer, the first included. So a layer *upstream* of an incident's primary layer is
where the fault may start only if its prompt rows changed. Each anomaly record says which
rows its finding was measured on (``measured_on``, ``docs/wire-format.md``); records of an
older monitor do not, and are counted as unknown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["LayerRows", "layer_rows"]


@dataclass(frozen=True)
class LayerRows:
    """A layer's findings by the rows they were measured on."""

    layer: int
    prompt: int = 0  #: on rows that see only the input
    decoding: int = 0  #: on rows of generated tokens among them
    unknown: int = 0  #: records that do not say

    def reading(self, relation: str) -> str:
        """What these findings say of a layer ``upstream`` or ``downstream`` of the
        incident's primary layer (or the ``primary`` itself)."""
        if relation == "downstream":
            return "downstream: it reads the primary layer's output, so it changes with it"
        if relation == "primary":
            if self.decoding and not self.prompt and not self.unknown:
                return ("only rows of generated tokens changed here: a fault in a later layer changes them too, so "
                        "check the layers after this one as well")
            return "the incident's own evidence"
        if self.prompt:
            return ("its prompt rows changed, which see only the input and no later layer can move: the fault may "
                    "start here; look at it first")
        if self.decoding and not self.unknown:
            return ("only its rows of generated tokens changed: they follow what the whole model generated, so a "
                    "fault in a later layer moves them too; no sign that the fault starts here")
        return ("the records do not say which rows changed (an older monitor): if its traces include generated "
                "tokens, a fault in a later layer moves them too")


def layer_rows(records: list[dict[str, Any]], model: str | None, revision: str | None, start: float = -math.inf,
               end: float = math.inf) -> dict[int, LayerRows]:
    """Per layer, the findings of the revision's anomaly records detected between
    ``start`` and ``end``, by the rows they were measured on."""
    counts: dict[int, list[int]] = {}
    for r in records:
        if not str(r.get("schema", "")).startswith("attention-anomaly"):
            continue
        if (r.get("model_id"), r.get("model_revision")) != (model, revision):
            continue
        if not start <= float(r.get("detected_at") or 0.0) <= end or not isinstance(r.get("layer"), int):
            continue
        slot = {"prompt": 0, "decoding": 1}.get(str(r.get("measured_on")), 2)
        counts.setdefault(r["layer"], [0, 0, 0])[slot] += 1
    return {layer: LayerRows(layer, *c) for layer, c in sorted(counts.items())}
