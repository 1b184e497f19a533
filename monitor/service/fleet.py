"""Each stream judged in one place, whatever the number of instances (``docs/scaling.md``).

Every instance does two steps, both committed in its one Kafka transaction:

1. :class:`Forwarding`: joined traces leave for ``attention-observations``, keyed by
   their judge (the model and the revision whose reference judges them:
   :meth:`monitor.core.pins.Pins.judge_revision`), one record per key and batch
   (``monitor.protocol.observations``);
2. :class:`Judges`: the observations partitions this instance owns are judged here, in
   order with everything else the judge is given; every ``STATE_SAVE_INTERVAL_S`` a
   round of their judges' state goes to the same partition of the compacted
   ``attention-judge-state`` (``monitor.protocol.judge_state``), in the transaction that
   commits the offsets it covers. When a partition moves here, :func:`take_over`
   installs its latest round and judges its observations since, silently.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from monitor.broker.connection import Connection
from monitor.broker.tail import read_range
from monitor.core.detect import Verdict
from monitor.core.incidents import IncidentTracker
from monitor.core.key_state import KeyState
from monitor.core.outcome import Outcome
from monitor.errors import TraceRejected
from monitor.measuring.measurer import Duplicate, Rejected
from monitor.measuring.workers import Measuring
from monitor.protocol import judge_state, observations
from monitor.protocol.observations import Forwarded, LateOutcome
from monitor.protocol.records import Output, Record, Source, TraceIdentity
from monitor.protocol.topics import Topics
from monitor.service.join import Waiting

__all__ = ["Forwarding", "Judges", "Judging", "take_over"]

log = logging.getLogger(__name__)
JudgeKey = tuple[str, str]  #: (model, the revision whose reference judges it)
Judged = list[tuple[Forwarded, Verdict | Duplicate | Rejected]]


class Forwarding:
    """A batch's joined traces on their way to their judges."""

    def __init__(self, topics: Topics, judged_by: Callable[[str, str], str]):
        self.topics, self.judged_by = topics, judged_by
        self._by_key: dict[bytes, list[Forwarded]] = {}
        self._late: dict[bytes, list[LateOutcome]] = {}

    def judge_of(self, trace: TraceIdentity) -> str:
        """The revision whose reference judges the trace (its judge key's)."""
        return self.judged_by(trace.model_id, trace.model_revision)

    def add(self, waiting: Waiting, outcome: Outcome) -> None:
        trace = waiting.trace
        key = observations.judge_key(trace.model_id, self.judge_of(trace))
        self._by_key.setdefault(key, []).append(Forwarded(trace, waiting.heads, waiting.metrics, outcome))

    def add_late(self, judged_by: str, late: LateOutcome) -> None:
        """The outcome of a request whose traces left ``pending``, for the judge they went to."""
        self._late.setdefault(observations.judge_key(late.model_id, judged_by), []).append(late)

    def records(self) -> list[Output]:
        """One record per judge key (more when they would exceed 512 KiB), its traces in
        the order they were joined, then its late outcomes; the batch starts afresh."""
        out = []
        for key in dict.fromkeys([*self._by_key, *self._late]):
            entries, late = self._by_key.get(key, []), self._late.get(key, [])
            source = entries[0].identity.source if entries else late[0].source
            out += [Output(self.topics.observations, key, value, source)
                    for value in observations.encode_within(entries, late=late)]
        self._by_key, self._late = {}, {}
        return out


@dataclass(frozen=True)
class Judging:
    """A batch's observation records: each one's entries, or why it could not be read,
    the judge's verdicts on all the entries in order, and a round of state if one is due."""

    entries: dict[Source, list[Forwarded] | TraceRejected]
    verdicts: Future[list[Verdict | Duplicate | Rejected]] | None
    #: the late outcomes of each readable record, taken after its entries
    late: dict[Source, list[LateOutcome]]
    states: Future[list[KeyState]] | None = None
    #: per owned observations partition: the offset the round has taken in, and its keys
    rounds: dict[int, tuple[int, list[JudgeKey]]] = field(default_factory=dict)


class Judges:
    """This instance as the judge of the observations partitions it owns."""

    def __init__(self, measuring: Measuring, topics: Topics, judged_by: Callable[[str, str], str],
                 interval: float, clock: Callable[[], float]):
        self.measuring, self.topics, self.judged_by = measuring, topics, judged_by
        self._interval, self._round_at, self._clock = interval, -math.inf, clock
        #: the owned partitions: the next offset after the batches queued, and the keys seen on each
        self._queued: dict[int, int] = {}
        self._keys_on: dict[int, set[JudgeKey]] = {}

    def take(self, records: list[Record]) -> Judging:
        """Read a batch's observation records and queue their entries for the judge (in
        order with the traces measured before and after them); a round of the judges'
        state after them when one is due."""
        entries: dict[Source, list[Forwarded] | TraceRejected] = {}
        late: dict[Source, list[LateOutcome]] = {}
        queued: list[Forwarded] = []
        for record in records:
            self._queued[record.partition] = record.offset + 1
            source = (record.topic, record.partition, record.offset)
            try:
                key, read = observations.read(record.key, record.value)
                late[source] = observations.decode_late(record.value)
            except TraceRejected as exc:
                entries[source] = exc
                continue
            self._keys_on.setdefault(record.partition, set()).add(key)
            entries[source] = read
            queued += read
        judging = Judging(entries, self.measuring.judge_forwarded(queued) if queued else None, late)
        if not self._queued or self._clock() - self._round_at < self._interval:
            return judging
        self._round_at = self._clock()
        keys = sorted({k for p in self._queued for k in self._keys_on.get(p, ())})
        return Judging(judging.entries, judging.verdicts, judging.late, self.measuring.key_states(keys),
                       {p: (offset, sorted(self._keys_on.get(p, ()))) for p, offset in self._queued.items()})

    def round(self, judging: Judging, incidents: IncidentTracker, now: float) -> list[Output]:
        """A round of the judges' state for each owned observations partition (due in
        ``judging``), to the same partition of the judge-state topic, with the open
        incidents of the revisions its keys judge."""
        if judging.states is None:
            return []
        states = {s.key: s for s in judging.states.result()}
        out = []
        for partition, (offset, keys) in sorted(judging.rounds.items()):
            source = (self.topics.observations, partition, offset)
            judged = set(keys)
            revisions = [k for k in incidents.open if (k[0], self.judged_by(*k)) in judged]
            records = judge_state.encode_round([states[k] for k in keys if k in states], offset,
                                               incidents.state(revisions, now))
            out += [Output(self.topics.judge_state, key, value, source, partition) for key, value in records]
        return out

    def restored(self, partition: int, keys: Iterable[JudgeKey], committed: int) -> None:
        """An observations partition moved here, its keys' state installed as of ``committed``."""
        self._keys_on.setdefault(partition, set()).update(keys)
        self._queued[partition] = committed

    def reassign(self, positions: dict[tuple[str, int], int], lost: set[int]) -> set[JudgeKey]:
        """After a rebalance: the observations partitions kept resume from ``positions``
        (one not read from since its takeover, from where the takeover left it), with
        every key they hold, read or taken over; the keys of those ``lost`` are returned."""
        gone = {key for p in lost for key in self._keys_on.get(p, ())}
        self._queued = {p: o for p, o in self._queued.items() if p not in lost}
        self._queued.update({p: o for (t, p), o in positions.items() if t == self.topics.observations})
        self._keys_on = {p: keys for p, keys in self._keys_on.items() if p not in lost}
        return gone


class Replaying(Protocol):
    """What a takeover hands its replayed verdicts to (the pipeline)."""

    judges: Judges

    def replayed(self, judged: Judged, incidents: list[dict[str, object]]) -> None: ...


def take_over(kafka: Connection, topics: Topics, partition: int, committed: int, measuring: Measuring,
              pipeline: Replaying) -> None:
    """Make this instance the judge of an observations partition (with no batch in
    flight): the latest round of its judges' state, then its observations from that
    round's offset to the committed one judged again, silently (their outputs were
    written by the instance that judged them first). Judge keys without state in the
    round start afresh: they began after it."""
    written = read_range(kafka, topics.judge_state, partition, None, None)
    try:
        found = judge_state.latest_round((key, value) for _, key, value in written)
    except TraceRejected as exc:
        log.error("observations partition %d: its judges' state is unreadable (%s); they learn afresh from "
                  "the committed offset %d", partition, exc.detail, committed)
        found = (committed, [], [])
    if found is not None and found[0] > committed:  # the group's offsets start over (a new GROUP_ID)
        log.warning("observations partition %d: its judges' state was written at offset %d, beyond the "
                    "committed %d; it is not this group's, they learn afresh", partition, found[0], committed)
        found = None
    start, docs, incidents = (None, [], []) if found is None else found
    states = [KeyState.from_dict(doc) for doc in docs]
    replayed: list[Forwarded] = []
    keys = {state.key for state in states}
    for _, key, value in read_range(kafka, topics.observations, partition, start, committed):
        try:
            judge, entries = observations.read(key, value)
        except TraceRejected:
            continue  # refused when it was first judged; nothing to rebuild from it
        keys.add(judge)
        replayed += entries
    begun_after = [KeyState(m, r) for m, r in sorted(keys - {state.key for state in states})]
    measuring.restore([*states, *begun_after])
    verdicts = measuring.judge_forwarded(replayed, again=True).result() if replayed else []
    pipeline.replayed(list(zip(replayed, verdicts, strict=True)), incidents)
    pipeline.judges.restored(partition, keys, committed)
    log.info("judging observations partition %d: %d judge keys' state and %d open incidents from the round at "
             "offset %s, %d traces judged again up to the committed offset %d", partition, len(states),
             len(incidents), "-" if found is None else start, len(replayed), committed)
