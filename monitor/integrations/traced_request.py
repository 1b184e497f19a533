"""One request traced under continuous batching, across the passes that serve it: its
plan (the prompt rows to trace, the decoding steps kept), the rows recomputed so far per
layer, and the traces they make when it ends (:mod:`~monitor.integrations.
continuous_batching` fills it; the tap's sender expands it into traces).
"""

from __future__ import annotations

import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from monitor.integrations.decoding import DecodeRows
from monitor.protocol.schema import Scope, TraceHeader


@dataclass
class LayerRows:
    prompt: dict[int, tuple[NDArray[np.float16], NDArray[np.float16] | None]]  #: position → [H, position+1], [H]
    decode: DecodeRows


@dataclass
class Stream:
    """One traced request of a continuous-batching manager, across the passes serving it."""

    engine_id: str
    request_id: str
    scope: Scope
    timestamp: float
    prompt_length: int
    rows: tuple[int, ...]  #: the prompt positions traced
    processor: weakref.ref[Any]
    decode_rows: int
    layers: dict[int, LayerRows] = field(default_factory=dict)
    closed: bool = False

    def layer(self, number: int) -> LayerRows:
        found = self.layers.get(number)
        if found is None:
            found = self.layers[number] = LayerRows({}, DecodeRows(self.decode_rows))
        return found

    def complete(self) -> bool:
        """Whether every traced layer has all its prompt rows."""
        return bool(self.layers) and all(len(rows.prompt) == len(self.rows) for rows in self.layers.values())

    def traces(self, templates: dict[int, TraceHeader]) -> list[tuple[Any, ...]]:
        """Header, weights ``[H, rows, keys]`` (and the learned sink's mass) of each layer:
        the prompt rows, then the decoding steps kept, over every key up to the last row."""
        out: list[tuple[Any, ...]] = []
        for number, rows in sorted(self.layers.items()):
            steps = rows.decode.chosen()
            prompt = sorted(rows.prompt)
            if not prompt and not steps:
                continue
            keys = steps[-1].keys if steps else self.prompt_length
            heads = (rows.prompt[prompt[0]][0] if prompt else steps[0].weights[0]).shape[0]
            weights = np.zeros((heads, len(prompt) + len(steps), keys), np.float16)
            sinks: list[NDArray[np.float16] | None] = []
            for r, position in enumerate(prompt):
                row, sink = rows.prompt[position]
                weights[:, r, : row.shape[-1]] = row
                sinks.append(sink)
            for r, step in enumerate(steps, start=len(prompt)):
                weights[:, r, : step.keys] = step.weights[0]
                sinks.append(None if step.sink is None else step.sink[0])
            extra = {"prompt_length": self.prompt_length} if steps else {}
            header = templates[number].model_copy(update={
                "trace_id": f"{self.request_id}/{number}/{uuid.uuid4().hex[:12]}" if len(self.request_id) <= 100
                else uuid.uuid4().hex,
                "request_id": self.request_id, "query_positions": (*prompt, *(s.position for s in steps)),
                "key_count": keys, "scope": self.scope, "timestamp": self.timestamp, **extra})
            if any(s is None for s in sinks):
                out.append((header, weights))
            else:
                out.append((header, weights, np.stack([s for s in sinks if s is not None], axis=-1)))
        return out
