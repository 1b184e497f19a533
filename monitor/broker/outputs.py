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
otherwise keep every read_committed reader of its partitions from reading past it).

This producer is kafka-python's, while everything that consumes is confluent-kafka's:
why, and when that changes, is written down in ``docs/delivery.md`` ("The two Kafka
clients").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
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
from monitor.errors import InfrastructureError
from monitor.protocol.records import Output
from monitor.protocol.topics import TRACE_RECORD_BYTES

log = logging.getLogger(__name__)
TP = tuple[str, int]
#: errors that say the group moved on: these partitions are someone else's now
REASSIGNED = (CommitFailedError, IllegalGenerationError, RebalanceInProgressError, UnknownMemberIdError)


class GroupMovedOn(InfrastructureError):
    """The group rebalanced while the batch was in flight; its offsets belong to a new
    owner, which re-reads the records. Nothing was committed."""

    def __init__(self, detail: str):
        super().__init__(f"the group moved on: {detail}", retriable=True)


class OutputProducer:
    def __init__(self, connection: Connection, transactional_id: str, *, delivery_timeout_ms: int = 120_000,
                 on_failure: Callable[[str], None] = lambda reason: None):
        """``on_failure`` hears of every failed transaction: ``aborted`` (sent again),
        ``stalled`` (still waiting for the broker after the delivery timeout),
        ``group_moved`` or ``fenced``."""
        self._on_failure = on_failure
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

        kafka-python waits without a limit for the coordinator to answer; while the
        transaction has not finished after the delivery timeout, ``waiting`` is called
        (and the wait counted as ``stalled``) once every delivery timeout, so the caller
        can say it is not ready. The transaction then finishes either way once the broker
        is back: committed, or aborted and raised here."""
        done = threading.Event()
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                self._transact(list(outputs), offsets, group)
                outcome.append(None)
            except BaseException as exc:  # handed to the caller's thread below
                outcome.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name="output-transaction", daemon=True).start()
        while not done.wait(self._patience_s):
            self._on_failure("stalled")
            waiting()
        if outcome[0] is not None:
            raise outcome[0]

    def _transact(self, outputs: list[Output], offsets: dict[TP, int], group: Any) -> None:
        producer = self._producer or self._start("cannot start a new transactional output producer")
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
                future.get(timeout=0)  # raises the error of a record that was not written
            producer.commit_transaction()
        except ProducerFencedError as exc:
            self._on_failure("fenced")
            raise from_kafka_python("another monitor instance with the same transactional id took over", exc) \
                from exc
        except REASSIGNED as exc:
            self._abort("group_moved", type(exc).__name__)
            raise GroupMovedOn(type(exc).__name__) from exc
        except MessageSizeTooLargeError as exc:  # sent again, it would be refused again: say so and stop
            self._abort("aborted", type(exc).__name__)
            sizes = ", ".join(f"{out.topic} {len(out.value):,} bytes" for out in sorted(
                outputs, key=lambda o: -len(o.value))[:3])
            raise InfrastructureError(f"an output record is larger than the producer or its topic takes ({exc}); "
                                      f"the largest: {sizes}. Create the topics with `attention-monitor topics "
                                      "create` (docs/scaling.md)", retriable=False) from exc
        except KafkaError as exc:
            self._abort("aborted", type(exc).__name__)
            raise InfrastructureError(f"writing outputs failed, transaction aborted: {type(exc).__name__}: {exc}",
                                      retriable=True) from exc

    def _abort(self, reason: str, error: str) -> None:
        """Abort the open transaction; a producer that cannot is thrown away, and the next
        attempt starts a new one, whose initialisation has the broker abort it."""
        self._on_failure(reason)
        log.warning("output transaction failed (%s): aborting it; its outputs and offsets will be sent again", error)
        started, producer = time.monotonic(), self._producer
        if producer is None:
            return
        try:
            producer.abort_transaction()
        except KafkaError as exc:
            log.warning("aborting the transaction failed too (%s: %s) after %.1f s: starting a new producer with the "
                        "same transactional id, which aborts it", type(exc).__name__, exc, time.monotonic() - started)
            self._producer = None
            _close_now(producer)

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
