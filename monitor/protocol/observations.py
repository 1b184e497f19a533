"""Records of the internal observations topic: what judging needs of measured traces,
on their way from the instance that measured them to the one that judges their stream
(the design: ``docs/architecture.md``, "Judging each stream in one place").

One record holds one judge key's observations of one transaction (as many records as
keep each within ``RECORD_BYTES``), in the order they were measured: kafka-python's
transactional producer costs per record, not per byte, so a record per trace would cost
the measuring instance several times what one per key and transaction does
(``docs/performance.md``, 2026-12-03). Never weights.

Key
    ``model_id``, a NUL byte, and the revision whose reference judges the traces (the
    trace's own revision, or the one it is pinned to): :func:`judge_key`.

Value
    ``b"AMOB"``, a version byte (1), the length of a JSON header (4 bytes, big-endian),
    the header, then each entry's metrics as little-endian float64, in the header's
    order: entropy, concentration, sink share, prompt mass, learned sink mass (``H``
    each), similarity (``H × H``), diversity and effective heads. The header is
    ``{"entries": [...], "late": [...]}``, each entry a trace's identity (the fields
    anomaly records carry), its head ids and its outcome (``outcome``: ``success``,
    ``failure``, ``pending`` when its join window closed without one, ``missing``; with
    ``outcome_label``, ``outcome_score`` and ``outcome_at`` when given). Prompt and learned
    sink mass are NaN where the trace says nothing of them, as the measurer leaves them.
    ``late`` (left out when empty) holds outcomes of requests whose traces were sent
    earlier as ``pending`` (:class:`LateOutcome`: a late outcome, or ``missing`` when the
    request's ``OUTCOME_WINDOW_S`` closed), after the entries of the record: a judge
    takes them after them.

The monitor writes these records itself, in transactions; a record it cannot read is
still refused with a :class:`~monitor.errors.TraceRejected` (``malformed``) naming what
is wrong, never an exception of another kind.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from monitor.core.detect import Observation
from monitor.core.metrics import HeadMetrics
from monitor.core.outcome import Outcome
from monitor.errors import RejectReason, TraceRejected
from monitor.protocol.records import Source, TraceIdentity

__all__ = ["MAGIC", "RECORD_BYTES", "VERSION", "Forwarded", "LateOutcome", "decode", "decode_late", "encode",
           "encode_within", "judge_key", "parse_key", "read"]

#: what an entry's outcome may say
RESULTS = ("success", "failure", "pending", "missing")

MAGIC = b"AMOB"
VERSION = 1
#: a record's value at most (the broker's default record limit is 1 MiB): a key's traces
#: of one transaction take as many records as they need
RECORD_BYTES = 512 * 1024
_PREFIX = struct.Struct(">4sBI")
#: a record's size before its first entry: the prefix and an empty header
_EMPTY = _PREFIX.size + len(b'{"entries":[]}')
#: per-head metrics in their order on the wire, then similarity, diversity, effective heads
_PER_HEAD = ("entropy", "concentration", "sink_share", "prompt_mass", "learned_sink")


@dataclass(frozen=True)
class Forwarded:
    """A measured trace joined to its outcome, as its judge receives it."""

    identity: TraceIdentity
    heads: tuple[str, ...]
    metrics: HeadMetrics  #: one trace's metrics (no batch dimension), without row masses
    outcome: Outcome  #: the task outcome, or ``pending`` when none came within the join's TTL
    #: the revision whose reference judges it, as its record's key names it (:func:`read`);
    #: None before it is keyed
    judged_by: str | None = None

    def observation(self) -> Observation:
        """What the detector judges: the trace, judged by the revision its key names."""
        i = self.identity
        return Observation(i.model_id, i.model_revision, i.layer, i.key_count, self.heads, self.metrics,
                           i.trace_timestamp, self.judged_by)


@dataclass(frozen=True)
class LateOutcome:
    """The outcome of a request whose traces left the join without one (``pending``), as
    its judge receives it: for each of the request's layers traced."""

    request_id: str
    model_id: str
    revision: str
    layers: tuple[int, ...]
    outcome: Outcome  #: a late outcome, or ``missing``: the request's OUTCOME_WINDOW_S closed
    trace_at: float  #: event time of the request's first trace
    source: Source  #: the outcome record it came from (none for ``missing``)

    def fields(self) -> dict[str, Any]:
        topic, partition, offset = self.source
        return {"request_id": self.request_id, "model_id": self.model_id, "model_revision": self.revision,
                "layers": list(self.layers), "trace_at": self.trace_at, **_outcome_fields(self.outcome),
                "source": {"topic": topic, "partition": partition, "offset": offset}}


def judge_key(model_id: str, judged_by: str) -> bytes:
    """The record key of a stream: its model and the revision whose reference judges it."""
    if "\x00" in model_id or "\x00" in judged_by:
        raise ValueError("a model id or revision holding a NUL byte cannot name a judge")
    return f"{model_id}\x00{judged_by}".encode()


def parse_key(key: bytes | None) -> tuple[str, str]:
    """(model id, judging revision) of a record key."""
    try:
        model_id, judged_by = (key or b"").decode().split("\x00")
    except ValueError as exc:  # not UTF-8 (UnicodeDecodeError is one), or not two parts
        raise _malformed(f"key {key!r} is not a model id and a revision") from exc
    return model_id, judged_by


def read(key: bytes | None, value: bytes | memoryview | None) -> tuple[tuple[str, str], list[Forwarded]]:
    """A record's judge key and its entries, each to be judged by the revision the key
    names (whatever the judge's own pins say: the instance that routed it decided);
    :class:`TraceRejected` (``malformed``) when either cannot be read."""
    model_id, judged_by = parse_key(key)
    entries = decode(value, judged_by)
    if any(e.identity.model_id != model_id for e in entries):
        raise _malformed(f"an entry of another model than its key's {model_id!r}")
    return (model_id, judged_by), entries


def encode(entries: Sequence[Forwarded]) -> bytes:
    """One record's value: ``entries`` in order (they may differ in head count)."""
    (value,) = encode_within(entries, limit=None)
    return value


def encode_within(entries: Sequence[Forwarded], limit: int | None = RECORD_BYTES,
                  late: Sequence[LateOutcome] = ()) -> list[bytes]:
    """``entries`` in order as few record values as hold them within ``limit`` bytes
    each (one entry alone may exceed it: it still gets a record); ``late`` outcomes in
    the last."""
    out: list[bytes] = []
    heads: list[str] = []  #: each entry's JSON, encoded once: its size counts, and the header joins them
    blocks: list[bytes] = []
    size = _EMPTY
    for e in entries:
        block = _block(e)
        head = json.dumps({**e.identity.fields(), "heads": list(e.heads), **_outcome_fields(e.outcome)},
                          separators=(",", ":"))
        more = len(block) + len(head) + 1
        if limit is not None and heads and size + more > limit:
            out.append(_value(heads, blocks))
            heads, blocks, size = [], [], _EMPTY
        heads.append(head)
        blocks.append(block)
        size += more
    if heads or late or not out:
        out.append(_value(heads, blocks, [item.fields() for item in late]))
    return out


def _block(e: Forwarded) -> bytes:
    """An entry's metrics as little-endian float64, in the wire's order."""
    h = len(e.heads)
    m = e.metrics
    block = np.empty(_floats(h), "<f8")
    for i, name in enumerate(_PER_HEAD):
        values = getattr(m, name)
        block[i * h:(i + 1) * h] = math.nan if values is None else _vector(values, h, name)
    start = len(_PER_HEAD) * h
    block[start:start + h * h] = np.asarray(m.similarity, np.float64).reshape(h * h)
    block[-2:] = float(m.diversity), float(m.effective_heads)
    return block.tobytes()


def _value(heads: list[str], blocks: list[bytes], late: list[dict[str, Any]] | None = None) -> bytes:
    """The record: the header ``{"entries": [...], "late": [...]}`` (as ``json.dumps`` with
    compact separators writes it) of the entries' JSON, then their metric blocks."""
    more = ',"late":' + json.dumps(late, separators=(",", ":")) if late else ""
    text = ('{"entries":[' + ",".join(heads) + "]" + more + "}").encode()
    return _PREFIX.pack(MAGIC, VERSION, len(text)) + text + b"".join(blocks)


def _outcome_fields(outcome: Outcome) -> dict[str, Any]:
    out: dict[str, Any] = {"outcome": outcome.result}
    if outcome.label is not None:
        out["outcome_label"] = outcome.label
    if outcome.score is not None:
        out["outcome_score"] = outcome.score
    if outcome.at:
        out["outcome_at"] = outcome.at
    return out


def _outcome(entry: dict[str, Any]) -> Outcome:
    result = str(entry["outcome"])
    if result not in RESULTS:
        raise _malformed(f"outcome {result!r} is none of {list(RESULTS)}")
    label, score = entry.get("outcome_label"), entry.get("outcome_score")
    return Outcome(result, None if label is None else str(label), None if score is None else float(score),
                   float(entry.get("outcome_at") or 0.0))


def decode(value: bytes | memoryview | None, judged_by: str | None = None) -> list[Forwarded]:
    """The entries of one record's value, in order (``judged_by``: the revision its key
    names, :func:`read`); :class:`TraceRejected` (``malformed``) naming what is wrong when
    it cannot be read."""
    data = bytes(value or b"")
    if len(data) < _PREFIX.size:
        raise _malformed(f"{len(data)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, version, size = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise _malformed(f"magic {magic!r} is not {MAGIC!r}")
    if version != VERSION:
        raise _malformed(f"version {version} is not {VERSION}")
    start = _PREFIX.size + size
    try:
        entries = json.loads(data[_PREFIX.size:start])["entries"]
        heads = [len(e["heads"]) for e in entries]
    except (ValueError, TypeError, KeyError) as exc:
        raise _malformed(f"unreadable header: {exc}") from exc
    expected = sum(_floats(h) for h in heads) * 8
    if len(data) - start != expected:
        raise _malformed(f"{len(data) - start} bytes of metrics where the header's head counts make {expected}")
    # one writable, aligned copy of the record's metrics: each entry's arrays are views of it
    floats = np.frombuffer(data, "<f8", offset=start).astype(np.float64)
    out, at = [], 0
    for entry, h in zip(entries, heads, strict=True):
        out.append(_entry(entry, h, floats[at: at + _floats(h)], judged_by))
        at += _floats(h)
    return out


def decode_late(value: bytes | memoryview | None) -> list[LateOutcome]:
    """The late outcomes of one record's value (after its entries); :class:`TraceRejected`
    (``malformed``) naming what is wrong when they cannot be read."""
    data = bytes(value or b"")
    if len(data) < _PREFIX.size or _PREFIX.unpack_from(data)[0] != MAGIC:
        raise _malformed("not an observations record")
    _, _, size = _PREFIX.unpack_from(data)
    if b'"late":' not in data[_PREFIX.size:_PREFIX.size + size]:
        return []
    try:
        late = json.loads(data[_PREFIX.size:_PREFIX.size + size]).get("late", [])
        out = []
        for item in late:
            source = item["source"]
            out.append(LateOutcome(str(item["request_id"]), str(item["model_id"]), str(item["model_revision"]),
                                   tuple(int(layer) for layer in item["layers"]), _outcome(item),
                                   float(item["trace_at"]),
                                   (str(source["topic"]), int(source["partition"]), int(source["offset"]))))
        return out
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _malformed(f"a late outcome is incomplete: {type(exc).__name__}: {exc}") from exc


def _floats(h: int) -> int:
    return len(_PER_HEAD) * h + h * h + 2


def _vector(values: Any, h: int, name: str) -> np.ndarray[Any, np.dtype[np.float64]]:
    if values is None:
        return np.full(h, math.nan)
    vector = np.asarray(values, np.float64).reshape(-1)
    if vector.shape != (h,):
        raise ValueError(f"{name} has {vector.size} values for {h} heads")
    return vector


def _entry(entry: dict[str, Any], h: int, floats: np.ndarray[Any, np.dtype[np.float64]],
           judged_by: str | None) -> Forwarded:
    try:
        source = entry["source"]
        identity = TraceIdentity(
            trace_id=str(entry["trace_id"]), request_id=str(entry["request_id"]), model_id=str(entry["model_id"]),
            model_revision=str(entry["model_revision"]), contract_id=str(entry["contract_id"]),
            layer=int(entry["layer"]), key_count=int(entry["key_count"]),
            trace_timestamp=float(entry["trace_timestamp"]),
            source=(str(source["topic"]), int(source["partition"]), int(source["offset"])),
            rows=_rows(entry.get("rows")))
        heads, outcome = tuple(map(str, entry["heads"])), _outcome(entry)
    except (KeyError, TypeError, ValueError) as exc:
        raise _malformed(f"an entry's identity is incomplete: {type(exc).__name__}: {exc}") from exc
    rest = len(_PER_HEAD) * h
    metrics = HeadMetrics(
        entropy=floats[:h], concentration=floats[h:2 * h], sink_share=floats[2 * h:3 * h],
        similarity=floats[rest:rest + h * h].reshape(h, h), diversity=floats[-2:-1].reshape(()),
        effective_heads=floats[-1:].reshape(()), prompt_mass=floats[3 * h:4 * h], learned_sink=floats[4 * h:5 * h])
    return Forwarded(identity, heads, metrics, outcome, judged_by)


def _malformed(detail: str) -> TraceRejected:
    return TraceRejected(RejectReason.MALFORMED, f"observations record: {detail}")


def _rows(rows: Any) -> tuple[int, int]:
    """An entry's (prompt, decoding) row counts; (0, 0), not known, for an entry written
    before they were carried."""
    if not isinstance(rows, dict):
        return 0, 0
    return int(rows.get("prompt", 0)), int(rows.get("decoding", 0))
