"""Records of the internal judge-state topic: the state of the judges of one
observations partition, so that it follows the partition to another instance
(the design: ``docs/architecture.md``).

Every ``STATE_SAVE_INTERVAL_S`` the instance that owns observations partition *i* writes,
in the transaction that commits its offsets, a *round* to partition *i* of this
compacted topic: one record per judge key and layer (the key's references of that layer
and the evidence and trace times of the layers it judges, from
:meth:`~monitor.core.detect.Detector.key_state`), then a marker. Every record of a round
carries the round's offset: the next observations offset its state has taken in. A new
owner installs the records of the latest round and judges, silently, the observations
from that offset to the committed one: the state the old owner committed, nothing lost
and nothing counted twice. Records of earlier rounds (keys gone since) are ignored.

Keys: ``model \\0 judged_by \\0 layer`` for a layer's state, ``\\0round`` for the marker.
Values: JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from monitor.core.key_state import KeyState
from monitor.errors import RejectReason, TraceRejected

__all__ = ["MARKER", "encode_round", "latest_round"]

MARKER = b"\x00round"


def encode_round(states: Iterable[KeyState | Mapping[str, Any]], offset: int,
                 incidents: Iterable[Mapping[str, Any]] = ()) -> list[tuple[bytes, bytes]]:
    """(key, value) records of a round of ``states`` (:class:`KeyState`, or its JSON
    form) that has taken in the observations below ``offset``; the marker last, with the
    open ``incidents`` of the revisions those keys judge."""
    out = []
    for state in states:
        whole = state if isinstance(state, KeyState) else KeyState.from_dict(state)
        for layer, part in whole.by_layer():
            key = f"{whole.model}\x00{whole.judged_by}\x00{layer}".encode()
            out.append((key, json.dumps({**part.to_dict(), "offset": offset}, separators=(",", ":")).encode()))
    out.append((MARKER, json.dumps({"offset": offset, "incidents": list(incidents)}).encode()))
    return out


def latest_round(records: Iterable[tuple[bytes | None, bytes | None]]
                 ) -> tuple[int, list[dict[str, Any]], list[dict[str, Any]]] | None:
    """The latest round among a partition's records, in offset order: its offset, the
    judge keys' states (:meth:`KeyState.to_dict`'s form) and the open incidents; None when
    no round was written. :class:`TraceRejected` (``malformed``) for a record that cannot
    be read."""
    marker: int | None = None
    incidents: list[dict[str, Any]] = []
    latest: dict[bytes, tuple[int, KeyState]] = {}
    for key, value in records:
        try:
            doc = json.loads(value or b"")
            if key == MARKER:
                marker, incidents = int(doc["offset"]), list(doc.get("incidents", []))
            elif key is not None:
                latest[key] = (int(doc["offset"]), KeyState.from_dict(doc))
        except (ValueError, TypeError, KeyError) as exc:
            raise TraceRejected(RejectReason.MALFORMED, f"judge state record {key!r}: {exc}") from exc
    if marker is None:
        return None
    # an earlier round's record: its key has no state in the latest one
    parts = [part for offset, part in latest.values() if offset == marker]
    return marker, [state.to_dict() for state in KeyState.joined(parts)], incidents
