"""What a judge holds, as values: a layer's live evidence, and one judge key's state.

:class:`LayerEvidence` is everything the detector keeps about one (model, revision,
layer) beside its reference: the finding and page CUSUM of every stream, the latest
trace times (its request rate) and the page threshold last worked out from them. One
value per layer, so nothing is kept in step by hand.

:class:`KeyState` is one judge key's state (a model and the revision whose reference
judges it, with the revisions pinned to it): its references and the evidence of every
layer it judges, frozen when taken. It has one serialisation, :meth:`KeyState.to_dict`
and :meth:`KeyState.from_dict`, used by the judge-state topic (split by layer,
:meth:`KeyState.by_layer`, and joined again), by a takeover, and, for the references, by
the state file (:func:`reference_item`, :func:`read_reference_item`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from monitor.core.reference import LengthReference

__all__ = ["RATE_WINDOW", "STATE_VERSION", "KeyState", "LayerEvidence", "LayerKey", "LayerState", "read_reference_item",
           "reference_item"]

STATE_VERSION = 3
#: timestamps kept per layer to measure its request rate
RATE_WINDOW = 128
LayerKey = tuple[str, str, int]  #: model, revision, layer


@dataclass
class LayerEvidence:
    """A layer's evidence, live: what the detector updates with every trace it judges."""

    cusum: NDArray[np.float64] | None = None  #: the finding CUSUM of every stream
    page_cusum: NDArray[np.float64] | None = None  #: the page CUSUM of every stream
    times: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))  #: latest trace times
    #: (references' version, traces timed, page threshold) when last worked out (not saved)
    page_h: tuple[int, int, float] | None = None

    def frozen(self, key: LayerKey) -> LayerState:
        return LayerState(key, _listed(self.cusum), _listed(self.page_cusum), tuple(self.times))

    @staticmethod
    def of(state: LayerState) -> LayerEvidence:
        return LayerEvidence(None if state.cusum is None else np.asarray(state.cusum, dtype=np.float64),
                             None if state.page_cusum is None else np.asarray(state.page_cusum, dtype=np.float64),
                             deque(state.times, maxlen=RATE_WINDOW))


@dataclass(frozen=True)
class LayerState:
    """A layer's evidence as taken: its statistics and trace times."""

    key: LayerKey
    cusum: tuple[float, ...] | None
    page_cusum: tuple[float, ...] | None
    times: tuple[float, ...]


@dataclass(frozen=True)
class KeyState:
    """One judge key's references and the evidence of the layers it judges."""

    model: str
    judged_by: str
    #: the references of ``judged_by``'s layers, as :meth:`LengthReference.to_dict` writes them
    references: tuple[tuple[LayerKey, Mapping[str, Any]], ...] = ()
    layers: tuple[LayerState, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return self.model, self.judged_by

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form (the judge-state topic's, and the state file's references')."""
        return {"version": STATE_VERSION, "model": self.model, "judged_by": self.judged_by,
                "references": [reference_item(k, doc) for k, doc in self.references],
                "layers": [{"key": list(s.key), "cusum": _plain(s.cusum), "page_cusum": _plain(s.page_cusum),
                            "times": list(s.times)} for s in self.layers]}

    @staticmethod
    def from_dict(doc: Mapping[str, Any]) -> KeyState:
        """:meth:`to_dict`'s form read back; ValueError (or KeyError, TypeError) when it
        is not that."""
        if doc.get("version") != STATE_VERSION:
            raise ValueError(f"judge state version {doc.get('version')} is not {STATE_VERSION}")
        references = tuple((_layer_key(item["key"]), dict(item["reference"])) for item in doc["references"])
        layers = tuple(LayerState(_layer_key(item["key"]), _floats(item["cusum"]), _floats(item["page_cusum"]),
                                  tuple(float(t) for t in item["times"])) for item in doc["layers"])
        return KeyState(str(doc["model"]), str(doc["judged_by"]), references, layers)

    def by_layer(self) -> list[tuple[int, KeyState]]:
        """The state cut by layer number (each part a record of its own), in layer order."""
        layers = sorted({k[2] for k, _ in self.references} | {s.key[2] for s in self.layers})
        return [(layer, KeyState(self.model, self.judged_by,
                                 tuple((k, d) for k, d in self.references if k[2] == layer),
                                 tuple(s for s in self.layers if s.key[2] == layer))) for layer in layers]

    @staticmethod
    def joined(parts: Iterable[KeyState]) -> list[KeyState]:
        """Parts (:meth:`by_layer`) put together again, one state per judge key."""
        out: dict[tuple[str, str], KeyState] = {}
        for part in parts:
            have = out.get(part.key)
            out[part.key] = part if have is None else KeyState(
                part.model, part.judged_by, have.references + part.references, have.layers + part.layers)
        return list(out.values())


def reference_item(key: LayerKey, reference: Mapping[str, Any]) -> dict[str, Any]:
    """A layer's reference as saved (:meth:`LengthReference.to_dict` under its key)."""
    return {"key": list(key), "reference": dict(reference)}


def read_reference_item(item: Mapping[str, Any]) -> tuple[LayerKey, LengthReference]:
    return _layer_key(item["key"]), LengthReference.from_dict(dict(item["reference"]))


def _layer_key(key: Any) -> LayerKey:
    model, revision, layer = key
    return str(model), str(revision), int(layer)


def _listed(values: NDArray[np.float64] | None) -> tuple[float, ...] | None:
    return None if values is None else tuple(float(v) for v in values)


def _plain(values: tuple[float, ...] | None) -> list[float] | None:
    return None if values is None else list(values)


def _floats(values: Any) -> tuple[float, ...] | None:
    return None if values is None else tuple(float(v) for v in values)
