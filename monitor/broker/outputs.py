"""Writes the monitor's outputs and commits the offsets they came from, together.

Every commit is one Kafka transaction (of one batch or of the batches that finished
together): its outputs (anomaly, incident and dead-letter records) and the consumer
offsets it allows to commit are sent, then committed at once,
so a crash or a broker outage leaves either both or neither. Readers of the outputs use
``isolation_level="read_committed"``. The offsets go with the consumer's group metadata
(KIP-447): after a rebalance an old owner's commit is refused by the broker instead of
overwriting the new owner's progress.

A transaction that fails (a broker outage longer than the delivery timeout, a coordinator
moving) is aborted and tried again with the same outputs and offsets, so nothing is lost
and nothing is written twice; every failure is counted and logged. Only a fatal error
(another producer fenced this one, or the group moved on) ends the attempt.

Two things kafka-python does not do for a transaction, done here. It commits a transaction
whose records expired after the delivery timeout (it fails their futures but leaves the
transaction committable): every record is waited for before the offsets and the commit,
and one that failed aborts the transaction instead (a broker restart during a batch
committed some of its dead letters, which the retry then wrote again). And a producer
that cannot abort its transaction (its state broken by the outage) is thrown away: a new
one with the same transactional id is started before the next attempt, and the broker
aborts the old one's open transaction when it initialises (an open transaction would
otherwise keep every read_committed reader of its partitions from reading past it). A
transaction kafka-python has not finished after the delivery timeout is given up on the
same way (:meth:`OutputProducer.commit`).

This producer is kafka-python's, while everything that consumes is confluent-kafka's:
why, and when that changes, is written down in ``docs/delivery.md`` ("The two Kafka
clients").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kafka import KafkaProducer, OffsetAndMetadata, TopicPartition
from kafka.errors import (
    CommitFailedError,
    IllegalGenerationError,
    KafkaError,
    MessageSizeTooLargeError,
    ProducerFencedError,
    RebalanceInProgressError,
    UnknownMemberIdError,
)

from monitor.broker.connection import Connection
from monitor.broker.errors import from_kafka_python
from monitor.broker.tail import is_committed
from monitor.errors import InfrastructureError
from monitor.protocol.records import Output
from monitor.protocol.topics import TRACE_RECORD_BYTES

log = logging.getLogger(__name__)
TP = tuple[str, int]
Location = tuple[str, int, int]  #: topic, partition, offset of a record written
#: errors that say the group moved on: these partitions are someone else's now
REASSIGNED = (CommitFailedError, IllegalGenerationError, RebalanceInProgressError, UnknownMemberIdError)


class GroupMovedOn(InfrastructureError):
    """The group rebalanced while the batch was in flight; its offsets belong to a new
    owner, which re-reads the records. Nothing was committed."""

    def __init__(self, detail: str):
        super().__init__(f"the group moved on: {detail}", retriable=True)


class InDoubt(InfrastructureError):
    """A transaction given up on after its commit was asked for: it may have committed.
    The group's committed offsets tell, or for a transaction without offsets (outputs of
    timers only: an incident closing, a request's outcome window closing) whether its
    first record, at ``written``, is committed (:meth:`monitor.service.delivery.Delivery`)."""

    def __init__(self, detail: str, written: Location | None = None):
        super().__init__(detail, retriable=True)
        self.written = written


@dataclass
class _Attempt:
    """One transaction as its waiting caller sees it: the producer it runs on, and
    whether its commit was asked for."""

    producer: Any
    committing: bool = False
    written: Location | None = None  #: where its first record was written (acknowledged, in the open transaction)


class OutputProducer:
    def __init__(self, connection: Connection, transactional_id: str, *, delivery_timeout_ms: int = 120_000,
                 on_failure: Callable[[str], None] = lambda reason: None):
        """``on_failure`` hears of every failed transaction: ``aborted`` (sent again),
        ``stalled`` (not finished after the delivery timeout: given up on, see
        :meth:`commit`), ``group_moved`` or ``fenced``."""
        self._on_failure = on_failure
        self._connection = connection
        self._patience_s = delivery_timeout_ms / 1000
        # retry_backoff_ms: right after a commit the coordinator answers the next
        # transaction's first request with CONCURRENT_TRANSACTIONS until its markers
        # are written; kafka-python's default backoff (100 ms) made every commit wait
        # that long again, 20 ms is the Java client's backoff for that case
        self._config: dict[str, Any] = dict(
            acks="all", enable_idempotence=True, transactional_id=transactional_id, linger_ms=5,
            retry_backoff_ms=20,
            # a judge's state may exceed the 1 MiB default (its topic allows it: monitor.protocol.topics)
            max_request_size=TRACE_RECORD_BYTES,
            delivery_timeout_ms=delivery_timeout_ms, request_timeout_ms=min(30_000, delivery_timeout_ms // 2),
            transaction_timeout_ms=max(60_000, 2 * delivery_timeout_ms), **connection.kafka_python())
        self._producer: KafkaProducer | None = None  #: None once thrown away, until the next attempt starts one
        self._start("cannot start the transactional output producer")

    def _start(self, action: str) -> KafkaProducer:
        """A new producer with the transactional id, initialised: the broker fences any
        older producer with that id and aborts its open transaction."""
        producer = None
        try:
            producer = KafkaProducer(**self._config)
            producer.init_transactions()
        except KafkaError as exc:
            if producer is not None:
                _close_now(producer)
            raise from_kafka_python(action, exc) from exc
        self._producer = producer
        return producer

    def commit(self, outputs: Iterable[Output], offsets: dict[TP, int], group: Any,
               waiting: Callable[[], None] = lambda: None) -> None:
        """Write ``outputs`` and commit ``offsets`` for ``group`` (the consumer's group
        metadata) in one transaction. Raises :class:`GroupMovedOn` when the group
        rebalanced meanwhile (nothing committed), :class:`InfrastructureError` when it
        could not commit (after aborting; retriable unless this producer was fenced).

        kafka-python waits without a limit for the coordinator to answer, and after a
        broker restart it may never answer (an AddOffsetsToTxn lost with its connection
        left ``send_offsets_to_transaction`` waiting for good). A transaction not finished
        after the delivery timeout (by then its records would have expired anyway) is
        counted as ``stalled``, ``waiting`` is called so the caller can say it is not
        ready, and it is given up on: its producer is thrown away (its thread is left
        waiting on it) and the next attempt starts a new one, whose initialisation fences
        the old one and has the broker abort its transaction. The error raised is
        retriable; :class:`InDoubt` when the commit had been asked for. Starting a new
        producer happens on the caller's thread, and raises while the broker is away."""
        producer = self._producer or self._start("cannot start a new transactional output producer")
        done = threading.Event()
        outcome: list[BaseException | None] = []
        attempt = _Attempt(producer)

        def run() -> None:
            try:
                self._transact(list(outputs), offsets, group, attempt)
                outcome.append(None)
            except BaseException as exc:  # handed to the caller's thread below
                outcome.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name="output-transaction", daemon=True).start()
        if not done.wait(self._patience_s):
            self._on_failure("stalled")
            waiting()
            self._give_up(producer)
            if attempt.committing:
                raise InDoubt(f"the output transaction's commit did not finish within the delivery timeout "
                              f"({self._patience_s:.0f} s); its producer is replaced", attempt.written)
            raise InfrastructureError(f"the output transaction did not finish within the delivery timeout "
                                      f"({self._patience_s:.0f} s); its producer is replaced and it is sent again",
                                      retriable=True)
        if outcome[0] is not None:
            raise outcome[0]

    def _give_up(self, producer: KafkaProducer) -> None:
        """Throw away the producer of a transaction that did not finish (its thread is left
        waiting on it); the next attempt starts a new one, whose initialisation fences it."""
        log.warning("the output transaction has not finished after the delivery timeout (%.0f s): giving up on its "
                    "producer; a new one with the same transactional id sends the batch again", self._patience_s)
        if self._producer is producer:
            self._producer = None
            threading.Thread(target=_close_now, args=(producer,), name="output-producer-close", daemon=True).start()

    def start(self) -> None:
        """A producer ready for the next transaction (a new one after one was given up on)."""
        if self._producer is None:
            self._start("cannot start a new transactional output producer")

    def landed(self, written: Location) -> bool:
        """Whether the transaction that wrote a record at ``written`` committed (asked of
        a transaction :class:`InDoubt` once :meth:`start` has ended it); raises while the
        broker cannot tell."""
        return is_committed(self._connection, *written)

    def _transact(self, outputs: list[Output], offsets: dict[TP, int], group: Any, attempt: _Attempt) -> None:
        producer = attempt.producer
        try:
            producer.begin_transaction()
            futures = [producer.send(out.topic, key=out.key, value=out.value, partition=out.partition)
                       for out in outputs]
            # every record acknowledged before the commit is asked for: kafka-python would
            # commit a transaction whose expired records it failed (see the module's docstring)
            if offsets:
                producer.send_offsets_to_transaction(
                    {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()}, group)
            producer.flush()
            for future in futures:
                written = future.get(timeout=0)  # raises the error of a record that was not written
                if attempt.written is None and written is not None:
                    attempt.written = (written.topic, written.partition, written.offset)
            attempt.committing = True
            producer.commit_transaction()
        except ProducerFencedError as exc:
            if producer is self._producer:  # not the one given up on: the next one fenced that
                self._on_failure("fenced")
            raise from_kafka_python("another monitor instance with the same transactional id took over", exc) \
                from exc
        except REASSIGNED as exc:
            self._abort(producer, "group_moved", type(exc).__name__)
            raise GroupMovedOn(type(exc).__name__) from exc
        except MessageSizeTooLargeError as exc:  # sent again, it would be refused again: say so and stop
            self._abort(producer, "aborted", type(exc).__name__)
            sizes = ", ".join(f"{out.topic} {len(out.value):,} bytes" for out in sorted(
                outputs, key=lambda o: -len(o.value))[:3])
            raise InfrastructureError(f"an output record is larger than the producer or its topic takes ({exc}); "
                                      f"the largest: {sizes}. Create the topics with `attention-monitor topics "
                                      "create` (docs/scaling.md)", retriable=False) from exc
        except KafkaError as exc:
            self._abort(producer, "aborted", type(exc).__name__)
            raise InfrastructureError(f"writing outputs failed, transaction aborted: {type(exc).__name__}: {exc}",
                                      retriable=True) from exc

    def _abort(self, producer: KafkaProducer, reason: str, error: str) -> None:
        """Abort ``producer``'s open transaction; a producer that cannot is thrown away, and
        the next attempt starts a new one, whose initialisation has the broker abort it.
        (A producer given up on already was replaced: nothing is counted for it.)"""
        current = self._producer
        if current is None or producer is not current:
            log.info("the output transaction given up on ended too (%s)", error)
            return
        self._on_failure(reason)
        log.warning("output transaction failed (%s): aborting it; its outputs and offsets will be sent again", error)
        started = time.monotonic()
        try:
            current.abort_transaction()
        except KafkaError as exc:
            log.warning("aborting the transaction failed too (%s: %s) after %.1f s: starting a new producer with the "
                        "same transactional id, which aborts it", type(exc).__name__, exc, time.monotonic() - started)
            if self._producer is current:
                self._producer = None
            _close_now(current)

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close()


def _close_now(producer: KafkaProducer) -> None:
    """Close a producer given up on without waiting for what it still holds (its open
    transaction is aborted by the next producer with its transactional id)."""
    try:
        producer.close(timeout=0)
    except KafkaError as exc:
        # close flushes first, and a flush that times out skips the sender's forced close
        log.info("closing the output producer given up on: %s: %s; its sender is stopped", type(exc).__name__, exc)
        sender = getattr(producer, "_sender", None)
        if sender is not None:
            sender.force_close()
