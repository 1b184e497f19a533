"""The values that travel along a record's path: what comes in from Kafka (:class:`Record`)
and what goes back out (:class:`Output`). Nothing here knows Kafka or the pipeline; every
other module may use them."""

from __future__ import annotations

from dataclasses import dataclass

#: topic, partition, offset of a record
Source = tuple[str, int, int]


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
