"""The dead-letter record: what was refused and why, never the weights.

A JSON object on the dead-letter topic, keyed like the refused record. It carries the
reason (closed set), a short detail, the record's coordinates, size and SHA-256 (to find
it again without copying it), and — only when the record's signature verified and its
header parsed — the header fields that identify it. Scope is reduced to its tenant and
data class; the weights, and anything derived from them, never appear.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from monitor.errors import RejectReason
from monitor.protocol.schema import TraceHeader

DETAIL_CHARS = 300
KEY_CHARS = 128
SAFE_HEADER_FIELDS = (
    "trace_id", "request_id", "model_id", "model_revision", "contract_id", "layer",
    "producer_id", "timestamp", "dtype", "key_count", "weights_source",
)


def dead_letter(
    reason: RejectReason,
    detail: str,
    *,
    topic: str,
    partition: int,
    offset: int,
    record: bytes | None,
    key: bytes | None,
    header: TraceHeader | None = None,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema": "attention-dead-letter/1",
        "reason": reason.value,
        "detail": detail[:DETAIL_CHARS],
        "source": {"topic": topic, "partition": partition, "offset": offset},
        "key": None if key is None else key.decode("utf-8", "replace")[:KEY_CHARS],
        "record_bytes": 0 if record is None else len(record),
        "record_sha256": None if record is None else hashlib.sha256(record).hexdigest(),
        "verified_header": None,
    }
    if header is not None:
        safe = {name: getattr(header, name) for name in SAFE_HEADER_FIELDS}
        safe.update(heads=len(header.heads), rows=len(header.query_positions),
                    tenant=header.scope.tenant, data_class=header.scope.data_class)
        doc["verified_header"] = safe
    return doc


def encode_dead_letter(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
