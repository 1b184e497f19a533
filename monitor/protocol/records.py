"""The values that travel along a record's path: what comes in from Kafka (:class:`Record`),
who a verified trace is (:class:`TraceIdentity`) and what goes back out (:class:`Output`).
Nothing here knows Kafka or the pipeline; every other module may use them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: topic, partition, offset of a record
Source = tuple[str, int, int]
#: the source of an output no record caused (a timer's: an incident closing, an outcome window closing)
NO_SOURCE: Source = ("", -1, -1)


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | memoryview | None  #: a memoryview in the measuring process (see monitor.measuring.workers)
    timestamp: float = 0.0  #: the record's time (its producer's clock), seconds since the epoch


@dataclass(frozen=True)
class Output:
    topic: str
    key: bytes | None
    value: bytes
    source: Source  #: the record it came from
    partition: int | None = None  #: where it must go (a judge's state: its observations' partition); None: by key


@dataclass(frozen=True)
class TraceIdentity:
    """Who a verified trace is: its ids, its model's exact identity, its layer and length,
    and where it was read. Anomaly records carry it (:meth:`fields`); it never holds
    weights."""

    trace_id: str
    request_id: str
    model_id: str
    model_revision: str
    contract_id: str
    layer: int
    key_count: int
    trace_timestamp: float  #: the producer's timestamp of the trace
    source: Source  #: topic, partition, offset of its record
    #: its sampled rows: (prompt rows, decoding rows). A row at a position before the
    #: header's ``prompt_length`` (or any row, without one) sees only the input; a
    #: decoding row sees the tokens generated so far. (0, 0): not known
    rows: tuple[int, int] = (0, 0)

    def fields(self) -> dict[str, Any]:
        """The identity as the JSON fields of an anomaly record (``docs/wire-format.md``)."""
        topic, partition, offset = self.source
        return {"trace_id": self.trace_id, "request_id": self.request_id, "model_id": self.model_id,
                "model_revision": self.model_revision, "contract_id": self.contract_id, "layer": self.layer,
                "key_count": self.key_count, "trace_timestamp": self.trace_timestamp,
                "source": {"topic": topic, "partition": partition, "offset": offset},
                "rows": {"prompt": self.rows[0], "decoding": self.rows[1]}}
