"""Completing a batch: its outputs and the offsets it allows, committed together.

Offsets are committed only in the transaction that writes the batch's outputs
(:class:`~monitor.broker.outputs.OutputProducer`), so nothing is committed without its
output. When the batch taught a reference something, the reference state is saved
first: a crash can never commit the traces that taught a reference it then forgets. A
transaction that fails is aborted and tried again, with the same outputs and offsets,
until it succeeds or the service is asked to stop; meanwhile ``/readyz`` says 503 (one
given up on after its commit was asked for is sent again only if it did not commit:
its offsets, or without offsets its first record, tell). When the group moved on (a
rebalance under way, or a commit refused for a generation the group left during an
outage), batches are held until the new assignment and then committed less what the
new owners of the partitions that moved do again; no new assignment within
:func:`rejoin_timeout_s` of a refusal, and the service ends with exit code 3: it
restarts from the committed offsets and reads back what was written, so nothing is
lost or doubled.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

from monitor.broker.group import GroupMember
from monitor.broker.outputs import GroupMovedOn, InDoubt, OutputProducer
from monitor.errors import InfrastructureError
from monitor.service.assignment import Assignment
from monitor.service.batch import Batch
from monitor.service.exporter import MonitorMetrics
from monitor.service.health import Health
from monitor.service.pipeline import Pipeline
from monitor.service.retry import Backoff

log = logging.getLogger(__name__)
TP = tuple[str, int]
#: how long a stop request waits for a failing commit before the service gives up on it
STOP_GRACE_S = 30.0


def rejoin_timeout_s(rebalance_timeout_ms: int) -> float:
    """How long after a refused commit an instance waits for its new assignment: a
    rebalance (the broker waits up to REBALANCE_TIMEOUT_MS for every member), and when
    the join was lost (a broker restarting as it came), librdkafka's wait for its answer
    (the same plus 3 s) and a second rebalance."""
    return 2 * rebalance_timeout_ms / 1000 + 10.0


class Delivery:
    def __init__(self, producer: OutputProducer, consumer: GroupMember, pipeline: Pipeline,
                 assignment: Assignment, metrics: MonitorMetrics, health: Health, stopping: threading.Event,
                 save_state: Callable[[], None], *, rejoin_timeout_s: float = 60.0):
        self.producer, self.consumer, self.pipeline = producer, consumer, pipeline
        self.assignment, self.metrics, self.health = assignment, metrics, health
        self.stopping = stopping
        self.save_state = save_state
        self.committed: dict[TP, int] = {}
        self.rejoin_timeout_s = rejoin_timeout_s
        #: batches completed while a rebalance was under way, written when it completes
        self.held: list[Batch] = []
        self._refused_at: float | None = None  #: when the group last refused a commit, until it reassigns

    def complete(self, batch: Batch) -> None:
        """Commit a batch's outputs with the offsets it allows for partitions still owned.

        A batch's outputs are only ever written in the transaction that commits its
        offsets, or not at all: a partition's new owner resumes from the group's commit,
        and outputs written without their offsets would be written by both (anomaly
        records twice). So while a rebalance is under way (partitions revoked, the new
        assignment not known yet), or after the group refused a commit for a generation
        it left, batches are held for :meth:`reassigned`; held for longer than
        ``rejoin_timeout_s`` after a refusal, the service stops (exit code 3) and
        restarts from the committed offsets."""
        self.assignment.reached(batch.positions)  # kept partitions resume after it
        self.held.append(batch)
        if self._refused_at is not None and time.monotonic() - self._refused_at > self.rejoin_timeout_s:
            raise InfrastructureError(f"the group refused a commit and gave this instance no new assignment within "
                                      f"{self.rejoin_timeout_s:.0f} s; restarting from the committed offsets",
                                      retriable=False)
        if not self.assignment.parked and self._refused_at is None:
            self._deliver(set())

    def reassigned(self, lost: set[TP]) -> None:
        """The rebalance completed with ``lost`` gone elsewhere: the batches held since
        it began (or since the group refused a commit) are committed with their kept
        partitions' offsets, without what the new owners of ``lost`` do again
        (:meth:`Batch.without`); dropped when the service stops first (read again from
        the commit)."""
        self._refused_at = None
        if self.held:
            outputs = sum(len(b.outputs) for b in self.held)
            kept = self._deliver(lost)
            if outputs:
                log.info("the group rebalanced with %d outputs of finished batches held: %d written, the rest left to "
                         "the new owners of %d partitions", outputs, kept, len(lost))

    def _deliver(self, lost: set[TP]) -> int:
        """Commit what is held, less what the new owners of ``lost`` do again; the
        outputs written. A commit the group refuses (it moved on to a generation this
        member has not joined yet) keeps the batch held."""
        batch = Batch.merged(self.held)
        if lost:
            batch = batch.without(lost, self.pipeline.topics)
        self.held = []
        committing = self.assignment.committing
        offsets = {tp: o for tp, o in batch.committable.items()
                   if tp in committing and self.committed.get(tp) != o}
        if not batch.outputs and not offsets:
            return 0  # an idle batch commits nothing
        if batch.taught:
            self.save_state()
        try:
            self._commit(batch, offsets)
        except GroupMovedOn as exc:
            self.held, self._refused_at = [batch], time.monotonic()
            self.health.commit_failed(str(exc))
            log.warning("%s: the batch is held until the group gives this instance its new assignment", exc)
            return 0
        self.committed.update(offsets)
        self.pipeline.committed(offsets)
        self.metrics.commits.inc()
        return len(batch.outputs)

    def _landed(self, landed: Callable[[], bool]) -> bool:
        """``landed()``, asked once a new producer is up (its initialisation ends the
        transaction given up on), retried while the broker cannot tell."""
        backoff = Backoff()
        while True:
            try:
                self.producer.start()
                return landed()
            except InfrastructureError as exc:
                if not exc.retriable or self.stopping.is_set():
                    raise
                self.health.commit_failed(f"asking whether a transaction given up on was committed: {exc}")
                backoff.wait()

    def _commit(self, batch: Batch, offsets: dict[TP, int]) -> None:
        backoff, stop_at = Backoff(), None
        while True:
            try:
                self.producer.commit(batch.outputs, offsets, self.consumer.group_metadata(),
                                     waiting=lambda: self.health.commit_failed("the transaction waits for the broker"))
                self.health.committed()
                return
            except InDoubt as exc:
                # given up on after its commit was asked for: its offsets, committed in the
                # same transaction, say whether it went through; a batch without offsets
                # (outputs of timers only) is told by its first record, committed or not
                self.health.commit_failed(str(exc))
                written = exc.written
                if offsets:
                    went_through = self._landed(lambda: self.consumer.committed(offsets) == offsets)
                    evidence = "its offsets are the group's committed ones" if went_through else \
                        "its offsets are not the group's"
                elif written is not None:
                    went_through = self._landed(functools.partial(self.producer.landed, written))
                    evidence = (f"its first record, {written[0]}/{written[1]}@{written[2]}, is "
                                f"{'committed' if went_through else 'not committed'}")
                else:  # nothing was written: nothing to double
                    went_through, evidence = False, "it wrote nothing"
                if went_through:
                    log.warning("%s, but it was committed (%s)", exc, evidence)
                    self.health.committed()
                    return
                log.warning("%s; the batch was not committed (%s): sending it again", exc, evidence)
                backoff.wait()
            except GroupMovedOn:
                raise  # nothing was committed: the batch waits for the group's new assignment
            except InfrastructureError as exc:
                if not exc.retriable:
                    raise
                self.health.commit_failed(str(exc))
                if self.stopping.is_set():
                    stop_at = stop_at or time.monotonic() + STOP_GRACE_S
                    if time.monotonic() > stop_at:
                        raise InfrastructureError("stopping with a batch not committed (it is read again at the "
                                                  "next start)", retriable=False) from exc
                backoff.wait()
