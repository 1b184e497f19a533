"""The byte layout of one trace record (format version 1); see ``docs/wire-format.md``.

::

    offset      size  field
    0           4     magic b"ATRC"
    4           1     format version (1)
    5           1     flags (bit 0: signed; other bits must be 0)
    6           1     key id length L (0 when unsigned)
    7           L     key id, UTF-8
    7+L         4     header length N, unsigned little-endian
    11+L        N     header, UTF-8 JSON (monitor.protocol.schema.TraceHeader)
    11+L+N      P     weights [heads, rows, keys], little-endian float16 or float32
    end-32      32    HMAC-SHA256 over every byte before it, under the named key (signed only)

No weight is ever written as text. The signature covers header and payload, so any
changed byte is detected; it is verified before the header is parsed.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from monitor.errors import RejectReason, TraceRejected

MAGIC = b"ATRC"
FORMAT_VERSION = 1
FLAG_SIGNED = 0x01
MAC_BYTES = 32
_FIXED = len(MAGIC) + 3  # magic, version, flags, key id length


@dataclass(frozen=True)
class Frame:
    """The sections of a record, as memoryviews into it (nothing copied)."""

    key_id: str | None
    header: memoryview
    payload: memoryview
    signed_part: memoryview
    mac: memoryview | None


def pack(header_json: bytes, payload: bytes | memoryview, key_id: str | None, secret: bytes | None) -> bytes:
    """Assemble a record; signed when ``key_id`` and ``secret`` are given."""
    signed = key_id is not None and secret is not None
    kid = key_id.encode() if signed and key_id is not None else b""
    if len(kid) > 255:
        raise ValueError("key id must be at most 255 bytes")
    head = MAGIC + bytes([FORMAT_VERSION, FLAG_SIGNED if signed else 0, len(kid)]) + kid
    body = head + struct.pack("<I", len(header_json)) + header_json + bytes(payload)
    if not signed or secret is None:
        return body
    return body + hmac.new(secret, body, hashlib.sha256).digest()


def unpack(data: bytes | memoryview, max_record_bytes: int, max_header_bytes: int) -> Frame:
    """Split a record into its sections, checking sizes before anything is read."""
    view = memoryview(data)
    if len(view) > max_record_bytes:
        raise TraceRejected(RejectReason.OVERSIZED, f"record of {len(view)} bytes exceeds {max_record_bytes}")
    if len(view) < _FIXED + 4 or bytes(view[:4]) != MAGIC:
        raise TraceRejected(RejectReason.MALFORMED, "not a trace record (bad magic or too short)")
    version, flags, kid_len = view[4], view[5], view[6]
    if version != FORMAT_VERSION:
        raise TraceRejected(RejectReason.UNKNOWN_SCHEMA_VERSION, f"record format version {version}")
    if flags & ~FLAG_SIGNED:
        raise TraceRejected(RejectReason.MALFORMED, f"unknown flags 0x{flags:02x}")
    signed = bool(flags & FLAG_SIGNED)
    if signed != (kid_len > 0):
        raise TraceRejected(RejectReason.MALFORMED, "signed flag and key id disagree")
    pos = _FIXED + kid_len
    tail = MAC_BYTES if signed else 0
    if len(view) < pos + 4 + tail:
        raise TraceRejected(RejectReason.MALFORMED, "record truncated before its header")
    try:
        key_id = bytes(view[_FIXED:pos]).decode() if signed else None
    except UnicodeDecodeError as exc:
        raise TraceRejected(RejectReason.MALFORMED, "key id is not UTF-8") from exc
    (header_len,) = struct.unpack_from("<I", view, pos)
    pos += 4
    if header_len > max_header_bytes:
        raise TraceRejected(RejectReason.OVERSIZED, f"header of {header_len} bytes exceeds {max_header_bytes}")
    if header_len == 0 or pos + header_len > len(view) - tail:
        raise TraceRejected(RejectReason.MALFORMED, "record truncated inside its header")
    end = len(view) - tail
    return Frame(
        key_id=key_id,
        header=view[pos : pos + header_len],
        payload=view[pos + header_len : end],
        signed_part=view[:end],
        mac=view[end:] if signed else None,
    )


def verify(frame: Frame, secret: bytes) -> bool:
    """Constant-time check of the record's HMAC-SHA256."""
    if frame.mac is None:
        return False
    expected = hmac.new(secret, frame.signed_part, hashlib.sha256).digest()
    return hmac.compare_digest(expected, bytes(frame.mac))
