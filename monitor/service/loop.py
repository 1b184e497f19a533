"""The Kafka loop: poll a batch, hand it to the pipeline, commit its outputs with its
offsets, repeat.

The batches that finish within ``COMMIT_INTERVAL_MS`` have their outputs and offsets
committed together, in one Kafka transaction (:mod:`monitor.service.delivery`), never
past a trace still waiting in the join buffer; re-processing after a crash is idempotent
by trace id (the judge's de-duplication window, rebuilt from the committed outputs
whenever a partition is assigned).

Measuring runs in child processes by default (:mod:`monitor.measuring.workers`): the loop
polls the next batch while they measure this one and the pipeline's thread accounts for
earlier ones, up to ``batches_in_flight`` batches at once.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Protocol, TypeVar

from monitor.broker.group import GroupMember
from monitor.broker.tables import TableReader
from monitor.broker.tail import read_back, read_range
from monitor.errors import InfrastructureError
from monitor.measuring.workers import Measuring
from monitor.protocol.codec import named_contract
from monitor.protocol.decisions import ReferenceTable
from monitor.protocol.model_contract import ContractTable
from monitor.protocol.records import Record, Source
from monitor.protocol.topics import Topics
from monitor.service.assignment import Assignment
from monitor.service.batch import Batch
from monitor.service.delivery import Delivery
from monitor.service.exporter import MonitorMetrics
from monitor.service.fleet import take_over
from monitor.service.health import Health
from monitor.service.pins import PinCheck
from monitor.service.pipeline import Pipeline
from monitor.service.retry import Backoff, retry
from monitor.service.state_file import StateSaver
from monitor.settings import Settings

__all__ = ["LAG_INTERVAL_S", "Loop"]

log = logging.getLogger(__name__)
T = TypeVar("T")
#: how often the broker is asked for the trace partitions' end offsets (lag and liveness)
LAG_INTERVAL_S = 2.0
#: how often the contracts and references topics are read for news (a trace naming a
#: contract not known yet makes the service read the contracts topic to its end at once)
TABLES_INTERVAL_S = 0.25
#: how long a stop waits at most for this instance to judge the observations it owns
DRAIN_S = 10.0


class Service(Protocol):
    """What the loop uses of the wired service (:class:`monitor.service.app.Service`)."""

    settings: Settings
    topics: Topics
    stopping: threading.Event
    assignment: Assignment
    metrics: MonitorMetrics
    health: Health
    contracts: ContractTable
    references: ReferenceTable
    pins: PinCheck

    def follow_pins(self) -> None: ...


class Loop:
    def __init__(self, service: Service, consumer: GroupMember, readers: list[TableReader], delivery: Delivery,
                 measuring: Measuring, pipeline: Pipeline, saver: StateSaver):
        self.service, self.consumer, self.readers, self.delivery = service, consumer, readers, delivery
        self.measuring, self.pipeline, self.saver = measuring, pipeline, saver
        self.settings, self.topics = service.settings, service.topics
        self.limits = self.settings.limits()

    def run(self) -> None:
        """Poll a batch and hand it to the pipeline at once; commit batches in order as
        they complete. Up to ``batches_in_flight`` polled batches are measured or
        accounted for at once, so the measuring worker always has the next one queued. A
        rebalance waits for every batch in flight, then is acted on, and only then does
        the pipeline get the poll that brought it."""
        s, service, consumer, measuring = self.settings, self.service, self.consumer, self.measuring
        running: deque[Future[Batch]] = deque()
        finished: list[Future[Batch]] = []  # done, waiting for the next commit
        lag_at = tables_at = committed_at = 0.0
        while not service.stopping.is_set():
            records = retry(lambda: consumer.poll(s.poll_timeout_ms), "poll")
            revoked, assigned = consumer.changes.take()
            service.assignment.revoke(revoked)  # not committed for from here on
            if time.monotonic() - tables_at >= TABLES_INTERVAL_S:
                tables_at = time.monotonic()
                for reader in self.readers:
                    reader.refresh()
            if self._names_unknown_contract(records):
                # a model server publishes a contract just before its first traces: read the
                # contracts topic to its end as of now, so those traces find it
                self._until_done(lambda: self.readers[0].load(10.0), "reading the contracts topic")
            measuring.check()  # a dead measuring process stops the service even when no traffic comes
            measuring.sync_contracts(service.contracts)
            measuring.sync_decisions(service.references)
            if revoked or assigned is not None:
                service.metrics.rebalances.inc()
                _complete(self.delivery, [*finished, *running])
                finished.clear()
                running.clear()
                if assigned is not None:  # possibly empty: this instance stands by
                    records = self._reassign(assigned, records)
                    service.health.assigned()
            running.append(self.pipeline.process(records))
            service.metrics.polled.inc(len(records))
            if len(running) > s.batches_in_flight or running[0].done():
                finished.append(running.popleft())
                while running and running[0].done():
                    finished.append(running.popleft())
            if finished and time.monotonic() - committed_at >= s.commit_interval_ms / 1000:
                # every batch done by now goes in one transaction: its latency and its
                # broker requests are paid once for them all
                committed_at = time.monotonic()
                _complete(self.delivery, finished)
                finished.clear()
            service.metrics.observe_contracts(service.contracts)
            service.follow_pins()
            service.metrics.observe_pins(*service.pins.check(service.contracts))
            if time.monotonic() - lag_at >= LAG_INTERVAL_S:
                lag_at = time.monotonic()
                self._check_broker()
            self.saver.maybe()
        self.pipeline.late.due()  # the requests awaiting a late outcome written with the last offsets
        running.append(self.pipeline.process([]))
        _complete(self.delivery, [*finished, *running])
        if self.delivery.held:  # a rebalance under way, or a refused commit: nothing of it is written
            log.warning("stopping with %d outputs of finished batches uncommitted (the group was rebalancing): their "
                        "partitions' next owner does them again from the committed offsets",
                        sum(len(b.outputs) for b in self.delivery.held))
        self._drain()
        log.info("stop requested: last batch committed")

    def _drain(self) -> None:
        """Before stopping, judge the observations this instance's own partitions hold up
        to their ends as of now (the last batches' own among them), for at most
        ``DRAIN_S``: a stopped instance leaves no stream unjudged that it could judge.
        Traces and outcomes polled meanwhile are left uncommitted, read again at the next
        start; a rebalance ends the drain (the partitions' new owner judges them)."""
        owned = [tp for tp in self.service.assignment.committing if tp[0] == self.topics.observations]
        if not owned:
            return
        try:
            ends = self.consumer.end_offsets(owned)
            committed = self.consumer.committed(owned)  # where a partition not read from yet stands
        except InfrastructureError as exc:
            log.warning("stopping without judging the last observations (%s): the next owner judges them", exc)
            return
        reached = self.service.assignment.positions

        def done(slack: int = 0) -> bool:
            """Every partition processed up to its end as of the stop (less ``slack``)."""
            return all(reached.get(tp, committed.get(tp, 0)) >= end - slack for tp, end in ends.items())

        if done():
            return
        log.info("stopping: judging the last observations of this instance's partitions first (at most %.0f s)",
                 DRAIN_S)
        deadline, quiet = time.monotonic() + DRAIN_S, 0
        # the last offset may be a transaction's marker, not a record: one short of the end is
        # the end once polls bring nothing more
        while time.monotonic() < deadline and not done() and not (quiet >= 2 and done(slack=1)):
            records = retry(lambda: self.consumer.poll(self.settings.poll_timeout_ms), "poll")
            revoked, assigned = self.consumer.changes.take()
            if revoked or assigned is not None:
                log.info("stopping: a rebalance ended judging the last observations (their new owner judges them)")
                return
            judged = [r for r in records if r.topic == self.topics.observations]
            quiet = 0 if judged else quiet + 1
            if judged:
                _complete(self.delivery, [self.pipeline.process(judged)])

    def _names_unknown_contract(self, records: list[Record]) -> bool:
        """Whether a trace of the poll names a contract this instance does not know (the
        header read unverified: a wrong name only costs a read of the contracts topic,
        or the trace's own rejection; an unreadable header is rejected whatever the
        contracts)."""
        named = {named_contract(r.value, self.limits) for r in records if r.topic == self.topics.traces}
        return any(name is not None and self.service.contracts.get(name) is None for name in named)

    def _until_done(self, action: Callable[[], T], what: str) -> T:
        """``action``'s result, retried while the broker is away (not ready meanwhile),
        until it succeeds or a stop is asked for."""
        backoff = Backoff()
        while True:
            try:
                done = action()
                self.service.health.broker_answered()
                return done
            except InfrastructureError as exc:
                if not exc.retriable or self.service.stopping.is_set():
                    raise
                self.service.health.broker_silent(f"{what}: {exc}")
                backoff.wait()

    def _check_broker(self) -> None:
        """Ask the broker for the trace partitions' end offsets: the lag, and whether it answers."""
        service = self.service
        try:
            owned = [tp for tp in service.assignment.owned if tp[0] == self.topics.traces]
            service.metrics.lag.set(service.assignment.lag(self.consumer.end_offsets(owned)))
            service.health.broker_answered()
        except InfrastructureError as exc:
            service.health.broker_silent(str(exc))

    def _reassign(self, assigned: set[tuple[str, int]], records: list[Record]) -> list[Record]:
        """Act on a completed rebalance, with no batch in flight; returns the records of
        the poll that brought it still to process (see :mod:`monitor.service.assignment`)."""
        service, consumer = self.service, self.consumer
        change = service.assignment.assign(assigned, records)
        self.delivery.reassigned(change.lost)  # the batches held while the group rebalanced
        consumer.seek(change.resume)
        emitted: set[Source] = set()
        committed: dict[tuple[str, int], int] = {}
        kafka = self.settings.kafka_connection()
        # what follows reads the broker: a broker restarting meanwhile is waited out (each
        # read is retried whole; nothing is taken in before its read is complete)
        if change.new:
            committed = self._until_done(lambda: consumer.committed(change.new), "reading the committed offsets")
            written = self._until_done(lambda: read_back(
                kafka, [self.topics.anomalies, self.topics.dead_letter, self.topics.observations], change.new,
                committed, self.settings.dedupe_window), "reading back the outputs of the assigned partitions")
            emitted = written.sources
            self.measuring.remember(written.trace_ids)  # a trace sent again after a restart stays a duplicate
            log.info("assigned %s; %d outputs already written for them, %d trace ids remembered", sorted(change.new),
                     len(emitted), len(written.trace_ids))
        if change.kept:
            log.info("rebalanced; kept %d partitions, resuming them where this instance left off", len(change.kept))
        if not assigned:
            log.info("assigned no partition (the group has more instances than %s has partitions): standing by, "
                     "ready, to take partitions over when an instance leaves", self.topics.traces)
        self.pipeline.reassign({tp: o for tp, o in service.assignment.positions.items() if tp in assigned},
                               change.lost, emitted)
        for topic, partition in sorted(change.new):
            if topic == self.topics.traces:  # its requests whose outcome may still come
                written_pending = self._until_done(
                    functools.partial(read_range, kafka, self.topics.pending, partition, None, None),
                    f"reading {self.topics.pending}")
                waiting = self.pipeline.late.rebuild(partition, (value for _, _, value in written_pending))
                log.info("trace partition %d: %d requests awaiting their outcome, from %s", partition, waiting,
                         self.topics.pending)
        for topic, partition in sorted(change.new):
            if topic == self.topics.observations:
                self._until_done(functools.partial(take_over, kafka, self.topics, partition,
                                                   committed[(topic, partition)], self.measuring, self.pipeline),
                                 f"taking over observations partition {partition}")
        return change.records


def _complete(delivery: Delivery, batches: Iterable[Future[Batch]]) -> None:
    """Commit these batches, in order, in one transaction (waiting for each to finish)."""
    done = [batch.result() for batch in batches]
    if done:
        delivery.complete(Batch.merged(done))
