"""Requests whose traces left the join before their outcome came, kept so that an outcome
that comes late is still attributed.

The join (:mod:`monitor.core.join`) holds a trace for ``JOIN_TTL_S`` only, because Kafka
offsets never pass a record still waiting there. What a late outcome needs of its request
is small and outlives the record: the model, the revision, the revision that judges it
and the layers traced. :class:`PendingOutcomes` keeps that for ``window`` seconds of event
time after the request's first trace, at most ``max_requests`` requests (the oldest
leaves first beyond that). An outcome then *settles* its request (:meth:`settle`); a
request whose window closes, or that is pushed out, *expires*: its outcome is missing.
A request leaves once, either way, so an outcome is never counted twice: a second one
finds nothing.

Every change is also kept as a :class:`Delta` per partition until taken
(:meth:`take_deltas`), so that the caller can write it with the offsets it commits and a
new owner of the partition can rebuild the table (:meth:`apply`, then :meth:`forget`).
Requests whose window closed are not listed one by one: a delta says the event time
through which every window closed (``through``), which is all a rebuild needs, so that
the deltas stay few (new requests, and the few that settle or are pushed out).

Memory: about 480 bytes per request with a 45-character request id and two layers
(``benchmarks/pending_bench.py``; ``docs/delivery.md``), so ``max_requests`` = 250,000 is
about 120 MB.
"""

from __future__ import annotations

import heapq
import math
import sys
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Delta", "Pending", "PendingOutcomes"]


@dataclass(slots=True)
class Pending:
    """A request awaiting its outcome past the join."""

    request_id: str
    model_id: str
    revision: str
    judged_by: str  #: the revision whose reference judges its traces
    layers: tuple[int, ...]  #: its traced layers that left the join, in order
    partition: int  #: its traces' partition (the outcome's too)
    at: float  #: event time of its first trace that left the join
    deadline: float  #: ``at + window``: after this, its outcome is missing
    written: bool = field(default=False, compare=False)  #: handed out in a delta already


@dataclass
class Delta:
    """What changed on one partition since the last :meth:`PendingOutcomes.take_deltas`:
    requests added or given a layer (their whole entry) and requests that left."""

    opened: dict[str, Pending] = field(default_factory=dict)
    closed: list[str] = field(default_factory=list)  #: settled, or pushed out (not those whose window closed)
    #: every request whose window closed by this event time left (set when taken)
    through: float = -math.inf
    expired: int = 0  #: requests whose window closed since the last delta (not listed)

    def __bool__(self) -> bool:
        return bool(self.opened or self.closed or self.expired)


class PendingOutcomes:
    def __init__(self, window: float, max_requests: int):
        if window <= 0 or max_requests <= 0:
            raise ValueError("window and max_requests must be positive")
        self.window = window
        self.max_requests = max_requests
        self._requests: OrderedDict[str, Pending] = OrderedDict()  #: in arrival order, oldest first
        self._deadlines: list[tuple[float, int, Pending]] = []  #: a heap; entries that left are skipped
        self._seq = 0
        self._deltas: dict[int, Delta] = {}
        self._interned: dict[str, str] = {}
        #: requests that left without an outcome, by cause: ``window`` closed, ``capacity``
        self.evictions: dict[str, int] = {"window": 0, "capacity": 0}

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def get(self, request_id: str) -> Pending | None:
        return self._requests.get(request_id)

    def requests(self) -> list[Pending]:
        """Every request waiting, oldest first."""
        return list(self._requests.values())

    def add(self, request_id: str, model_id: str, revision: str, judged_by: str, layer: int, partition: int,
            at: float) -> list[Pending]:
        """A trace of the request left the join without an outcome: keep the request (or
        add the layer to it). Returns the requests pushed out to make room (their outcome
        is missing)."""
        entry = self._requests.get(request_id)
        if entry is not None:
            if layer not in entry.layers:
                entry.layers = (*entry.layers, layer)
                self._delta(entry.partition).opened[request_id] = entry
            return []
        out = []
        while len(self._requests) >= self.max_requests:
            out.append(self._leave(next(iter(self._requests)), "capacity", said=True))
        entry = Pending(request_id, self._intern(model_id), self._intern(revision), self._intern(judged_by),
                        (layer,), partition, at, at + self.window)
        self._insert(entry)
        self._delta(partition).opened[request_id] = entry
        return out

    def settle(self, request_id: str) -> Pending | None:
        """The request's outcome came: its entry, which leaves (None if it is not here:
        never traced, already settled or expired)."""
        if request_id not in self._requests:
            return None
        return self._leave(request_id, None, said=True)

    def expire(self, now: float) -> list[Pending]:
        """Requests whose window closed by event time ``now``: their outcome is missing.
        Not said in the deltas one by one: the next :meth:`take_deltas` says ``now``."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, entry = heapq.heappop(self._deadlines)
            if self._requests.get(entry.request_id) is entry:
                out.append(self._leave(entry.request_id, "window", said=False))
                self._delta(entry.partition).expired += 1
        return out

    def drop_partitions(self, partitions: Iterable[int]) -> list[Pending]:
        """Forget the requests of partitions no longer owned here (their new owner rebuilds
        them, :meth:`apply`); returns them."""
        gone = set(partitions)
        doomed = [r for r, e in self._requests.items() if e.partition in gone]
        for partition in gone:
            self._deltas.pop(partition, None)
        return [self._requests.pop(request_id) for request_id in doomed]

    def take_deltas(self, expired_through: float) -> dict[int, Delta]:
        """The changes since last asked, per partition (then forgotten here), each saying
        that every request of its partition whose window closed by ``expired_through``
        left (call :meth:`expire` with it first)."""
        deltas, self._deltas = {p: d for p, d in self._deltas.items() if d}, {}
        for delta in deltas.values():
            delta.through = expired_through
            for entry in delta.opened.values():
                entry.written = True
        return deltas

    def apply(self, delta: Delta) -> None:
        """Rebuild: a delta written earlier (in the order written). Records no change;
        call :meth:`forget` after the last one."""
        for request_id in delta.closed:
            self._requests.pop(request_id, None)
        for request_id, entry in delta.opened.items():
            self._requests.pop(request_id, None)
            self._insert(Pending(request_id, self._intern(entry.model_id), self._intern(entry.revision),
                                 self._intern(entry.judged_by), entry.layers, entry.partition, entry.at,
                                 entry.at + self.window, written=True))

    def forget(self, through: float) -> int:
        """After a rebuild: requests whose window had closed by ``through`` (the newest
        delta's) left where they were written, counted there; they leave here silently.
        Returns how many."""
        gone = 0
        while self._deadlines and self._deadlines[0][0] <= through:
            _, _, entry = heapq.heappop(self._deadlines)
            if self._requests.get(entry.request_id) is entry:
                del self._requests[entry.request_id]
                gone += 1
        return gone

    def _insert(self, entry: Pending) -> None:
        self._requests[entry.request_id] = entry
        self._seq += 1
        heapq.heappush(self._deadlines, (entry.deadline, self._seq, entry))
        if len(self._deadlines) > 2 * len(self._requests) + 1024:  # drop the entries that left
            self._deadlines = [d for d in self._deadlines if self._requests.get(d[2].request_id) is d[2]]
            heapq.heapify(self._deadlines)

    def _leave(self, request_id: str, cause: str | None, said: bool) -> Pending:
        entry = self._requests.pop(request_id)
        if cause is not None:
            self.evictions[cause] += 1
        delta = self._delta(entry.partition)
        delta.opened.pop(request_id, None)
        if entry.written and said:  # a rebuild would bring it back: say it left
            delta.closed.append(request_id)
        return entry

    def _delta(self, partition: int) -> Delta:
        delta = self._deltas.get(partition)
        if delta is None:
            delta = self._deltas[partition] = Delta()
        return delta

    def _intern(self, value: str) -> str:
        """Model ids and revisions repeat across requests: one string object each."""
        found = self._interned.get(value)
        if found is None:
            if len(self._interned) > 4 * 1024:  # bounded: a flood of invented ids is not kept
                self._interned.clear()
            found = self._interned[value] = sys.intern(value)
        return found
