"""Joining traces to task outcomes by request id, in either arrival order.

Times are *event* times (when the record was produced, not when it was read): a trace
waits for its outcome until the caller's clock passes its time plus ``ttl``, then leaves
with outcome ``missing``; an outcome waits as long for traces (a request has a trace per
traced layer, so an outcome stays to meet them all). Adding never expires anything: only
:meth:`JoinBuffer.expire`, with a watermark the caller trusts, does — so a backlog whose
outcomes are read far ahead of their traces joins as live traffic would. The buffer holds at most ``max_entries``
traces plus outcomes: beyond that the oldest entry is evicted (a trace leaves with
``missing``), and evictions are counted by cause (``ttl``, ``capacity``). An outcome
that leaves having met no trace is counted in :attr:`JoinBuffer.unmatched`.

An outcome is any value (a word, or a richer value with a label and a score); a
trace that leaves without one leaves with ``left_without`` (``missing`` by default).

For at-least-once delivery the buffer tells, per partition, the smallest offset still
waiting: a consumer must not commit past it, or a crash would lose the wait. It keeps a
heap of offsets per partition (entries that left are dropped lazily), so asking costs
O(partitions), not a scan of every waiting entry.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
MISSING = "missing"


@dataclass(frozen=True)
class Joined(Generic[T]):
    item: T
    outcome: Any  #: the outcome's value (any: a word, or one with a label and a score)
    partition: int
    offset: int


@dataclass
class _Entry(Generic[T]):
    request_id: str
    partition: int
    offset: int
    deadline: float
    item: T | None = None  # a trace's payload
    outcome: Any = None  # an outcome's value
    met: bool = False  # an outcome that met a trace (or was taken elsewhere)


class JoinBuffer(Generic[T]):
    def __init__(self, ttl: float, max_entries: int, left_without: Any = MISSING):
        if ttl <= 0 or max_entries <= 0:
            raise ValueError("ttl and max_entries must be positive")
        self.ttl = ttl
        self.max_entries = max_entries
        self.left_without = left_without
        #: outcomes that left having met no trace (and were not taken elsewhere: ``add_outcome(met=True)``)
        self.unmatched = 0
        self._entries: OrderedDict[int, _Entry[T]] = OrderedDict()  # insertion order = deadline order
        self._traces: dict[str, set[int]] = {}
        self._outcomes: dict[str, int] = {}
        self._offsets: dict[tuple[bool, int], list[tuple[int, int]]] = {}  #: (is trace, partition) -> (offset, seq)
        self._seq = 0
        self.evictions: dict[str, int] = {"ttl": 0, "capacity": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def waiting(self) -> Iterator[tuple[str, int, int]]:
        """What waits, oldest first: ``("trace" | "outcome", partition, offset)``."""
        for entry in self._entries.values():
            yield ("trace" if entry.item is not None else "outcome", entry.partition, entry.offset)

    def add_trace(self, request_id: str, item: T, partition: int, offset: int, now: float) -> list[Joined[T]]:
        """A processed trace; joined at once if its outcome is here."""
        seq = self._outcomes.get(request_id)
        if seq is not None:
            entry = self._entries[seq]
            assert entry.outcome is not None
            entry.met = True
            return [Joined(item, entry.outcome, partition, offset)]
        out = self._make_room(now)
        self._put(_Entry(request_id, partition, offset, now + self.ttl, item=item))
        self._traces.setdefault(request_id, set()).add(self._seq)
        return out

    def add_outcome(self, request_id: str, outcome: Any, partition: int, offset: int, now: float,
                    met: bool = False) -> list[Joined[T]]:
        """An outcome; joins every trace of the request waiting here, then waits for more
        (``met``: it was taken elsewhere already, so it does not count as unmatched)."""
        joined = []
        for seq in sorted(self._traces.pop(request_id, ())):
            entry = self._entries.pop(seq)
            assert entry.item is not None
            joined.append(Joined(entry.item, outcome, entry.partition, entry.offset))
        met = met or bool(joined)
        old = self._outcomes.pop(request_id, None)
        if old is not None:  # replaced: it leaves, unmatched unless it met a trace
            self.unmatched += not self._entries.pop(old).met
        joined += self._make_room(now)
        self._put(_Entry(request_id, partition, offset, now + self.ttl, outcome=outcome, met=met))
        self._outcomes[request_id] = self._seq
        return joined

    def expire(self, now: float) -> list[Joined[T]]:
        """Traces whose wait is over leave with outcome ``missing``; old outcomes go."""
        out = []
        while self._entries:
            seq, entry = next(iter(self._entries.items()))
            if entry.deadline > now:
                break
            out += self._evict(seq, "ttl")
        return out

    def oldest_offsets(self) -> tuple[dict[int, int], dict[int, int]]:
        """Smallest waiting offset per partition, for traces and for outcomes."""
        traces: dict[int, int] = {}
        outcomes: dict[int, int] = {}
        for key in list(self._offsets):
            heap = self._offsets[key]
            while heap and heap[0][1] not in self._entries:
                heapq.heappop(heap)
            if not heap:
                del self._offsets[key]
                continue
            is_trace, partition = key
            (traces if is_trace else outcomes)[partition] = heap[0][0]
        return traces, outcomes

    def drop_partitions(self, partitions: Iterable[int]) -> list[T]:
        """Forget everything from partitions this consumer no longer owns (their new
        owner re-reads them from the last commit). Returns the dropped traces."""
        gone = set(partitions)
        doomed = [seq for seq, e in self._entries.items() if e.partition in gone]
        return [item for item in (self._remove(seq).item for seq in doomed) if item is not None]

    def _put(self, entry: _Entry[T]) -> None:
        self._seq += 1
        self._entries[self._seq] = entry
        heapq.heappush(self._offsets.setdefault((entry.item is not None, entry.partition), []),
                       (entry.offset, self._seq))

    def _make_room(self, now: float) -> list[Joined[T]]:
        out: list[Joined[T]] = []
        while len(self._entries) >= self.max_entries:
            out += self._evict(next(iter(self._entries)), "capacity")
        return out

    def _evict(self, seq: int, cause: str) -> list[Joined[T]]:
        entry = self._remove(seq)
        self.evictions[cause] += 1
        if entry.item is None:
            self.unmatched += not entry.met
            return []
        return [Joined(entry.item, self.left_without, entry.partition, entry.offset)]

    def _remove(self, seq: int) -> _Entry[T]:
        entry = self._entries.pop(seq)
        if entry.item is not None:
            waiting = self._traces.get(entry.request_id)
            if waiting is not None:
                waiting.discard(seq)
                if not waiting:
                    del self._traces[entry.request_id]
        elif self._outcomes.get(entry.request_id) == seq:
            del self._outcomes[entry.request_id]
        return entry


class RecentKeys:
    """The last ``capacity`` keys seen: a bounded window for de-duplication."""

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def discard(self, key: Hashable) -> None:
        self._keys.pop(key, None)

    def add(self, key: Hashable) -> bool:
        """Remember ``key``; False if it was already in the window."""
        if key in self._keys:
            self._keys.move_to_end(key)
            return False
        self._keys[key] = None
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        return True
