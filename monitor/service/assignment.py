"""Which partitions this instance owns, and what a rebalance means for them.

The range assignor is eager: every rebalance first revokes everything, then assigns the
full new set. A revocation only *parks* partitions (nothing is written or committed for
them from then on: the batches that finish meanwhile are held by
:class:`monitor.service.delivery.Delivery` until it completes); the rebalance is complete when
the new assignment arrives, and only then is the state of partitions that went
elsewhere dropped.

Kept partitions resume where this instance left off. The poll that brought the
rebalance may already hold records of them, read from wherever the consumer's position
was reset to: those below the position reached are dropped (processed already), and the
partition resumes after the last one kept, never before it.

Where processing has reached on each owned partition (:attr:`Assignment.positions`) is
the service's own record, kept here: the consumer's position runs ahead of it (records
fetched, not yet processed), the group's commit behind it (held back for the join).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from monitor.protocol.records import Record

TP = tuple[str, int]


@dataclass(frozen=True)
class Reassignment:
    """What a completed rebalance asks of the service."""

    lost: set[TP]  #: owned before, now elsewhere: drop their waiting state
    kept: set[TP]  #: owned before and after: resume where this instance left off
    new: set[TP]  #: newly owned: resume from the group's commit
    records: list[Record]  #: the records of the poll that brought it still to process
    resume: dict[TP, int]  #: where kept partitions resume (after the records kept)


@dataclass
class Assignment:
    owned: set[TP] = field(default_factory=set)
    parked: set[TP] = field(default_factory=set)
    #: the next offset to process of each owned partition, after the batches completed so far
    positions: dict[TP, int] = field(default_factory=dict)

    def revoke(self, revoked: set[TP]) -> None:
        self.parked |= revoked

    def reached(self, positions: Mapping[TP, int]) -> None:
        """A batch completed: these partitions' next offsets to process. Positions of
        parked partitions are kept too (they may come back in the new assignment and
        resume there); those of partitions no longer owned are not."""
        self.positions.update({tp: o for tp, o in positions.items() if tp in self.owned})

    def lag(self, end: Mapping[TP, int]) -> int:
        """Records between where processing has reached and ``end``, over the owned
        partitions given (one not reached yet counts from its end: nothing known)."""
        return sum(max(0, o - self.positions.get(tp, o)) for tp, o in end.items())

    @property
    def committing(self) -> set[TP]:
        """Partitions surely still this instance's: only these are committed."""
        return self.owned - self.parked

    def assign(self, assigned: set[TP], records: list[Record]) -> Reassignment:
        """Complete a rebalance: ``assigned`` is the new set, ``records`` the poll that
        brought it."""
        lost = self.parked - assigned
        kept = assigned & self.owned
        new = assigned - self.owned
        self.parked, self.owned = set(), set(assigned)
        for tp in lost | new:
            self.positions.pop(tp, None)
        resume = {tp: self.positions[tp] for tp in kept if tp in self.positions}
        still = [r for r in records if (r.topic, r.partition) in assigned
                 and r.offset >= resume.get((r.topic, r.partition), -1)]
        for r in still:
            tp = (r.topic, r.partition)
            if tp in resume:
                resume[tp] = max(resume[tp], r.offset + 1)
        return Reassignment(lost, kept, new, still, resume)
