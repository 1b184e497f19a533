"""The internal topic ``attention-pending-outcomes``: what a new owner of a trace partition
needs to attribute the late outcomes of its requests (``docs/delivery.md``).

Partition *i* holds the changes of trace partition *i*'s requests awaiting their outcome
past the join (:class:`monitor.core.pending.Delta`): a record every few seconds
(``monitor.service.late.FLUSH_S``) and whenever outcomes settle requests, written with
the offsets it commits. A new owner reads the partition from its beginning, applies the
records in order (:meth:`~monitor.core.pending.PendingOutcomes.apply`) and forgets the
requests whose window had closed by the last record's ``through``. The topic deletes
records older than its retention, which must exceed ``OUTCOME_WINDOW_S`` (``topics
create`` sets it from that setting, plus a day).

Value, JSON: ``{"schema": "attention-pending/1", "opened": [[model, revision, judged_by,
[[request_id, [layers], at], ...]], ...], "closed": [request_id, ...], "through": t}``;
requests of one (model, revision, judged_by) share its names; ``closed`` lists requests
settled or pushed out, ``through`` the event time by which every request whose window
closed had left. Never weights, metrics or outcomes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

from monitor.core.pending import Delta, Pending
from monitor.errors import RejectReason, TraceRejected

__all__ = ["SCHEMA", "decode", "encode"]

SCHEMA = "attention-pending/1"
#: requests per record at most (about 100 bytes each): a record stays well within 1 MiB
MAX_REQUESTS = 5000


def encode(delta: Delta) -> Iterator[bytes]:
    """The records of one partition's delta (several when it is large: the requests that
    left first, then those added, as :meth:`~monitor.core.pending.PendingOutcomes.apply`
    takes them)."""
    closed = list(delta.closed)
    for start in range(0, len(closed), MAX_REQUESTS):
        yield _record([], closed[start:start + MAX_REQUESTS], delta.through)
    opened = list(delta.opened.values())
    for start in range(0, len(opened), MAX_REQUESTS):
        yield _record(opened[start:start + MAX_REQUESTS], [], delta.through)
    if not closed and not opened:
        yield _record([], [], delta.through)


def _record(opened: list[Pending], closed: list[str], through: float) -> bytes:
    by_key: dict[tuple[str, str, str], list[list[Any]]] = {}
    for e in opened:
        by_key.setdefault((e.model_id, e.revision, e.judged_by), []).append([e.request_id, list(e.layers), e.at])
    return json.dumps({"schema": SCHEMA, "opened": [[*key, requests] for key, requests in by_key.items()],
                       "closed": closed, "through": through if math.isfinite(through) else None},
                      separators=(",", ":")).encode()


def decode(value: bytes | None, partition: int) -> Delta:
    """A record of trace partition ``partition``'s requests; ``TraceRejected``
    (``malformed``) naming why when it cannot be read."""
    try:
        doc = json.loads(value or b"")
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise ValueError(f"not an {SCHEMA} record")
        delta = Delta()
        for model, revision, judged_by, requests in doc["opened"]:
            for request_id, layers, at in requests:
                delta.opened[str(request_id)] = Pending(str(request_id), str(model), str(revision), str(judged_by),
                                                        tuple(int(layer) for layer in layers), partition, float(at),
                                                        float(at))
        delta.closed = [str(request_id) for request_id in doc["closed"]]
        delta.through = -math.inf if doc.get("through") is None else float(doc["through"])
        return delta
    except (ValueError, TypeError, KeyError) as exc:
        raise TraceRejected(RejectReason.MALFORMED, f"pending outcomes record: {exc}") from exc
