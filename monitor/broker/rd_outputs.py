"""The output producer on librdkafka (see :mod:`monitor.broker.outputs` for what a
transaction holds and how failures are handled, and :mod:`monitor.broker.librdkafka`).

librdkafka says what a failed transactional call means through its error: fatal (this
producer was fenced, or can go no further), abortable (abort, then send the same
outputs and offsets again), or one of the group's errors when the offsets were refused
because the group rebalanced (KIP-447).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer, TopicPartition

from monitor.broker.librdkafka import error_of, librdkafka_config, rd_infrastructure_error
from monitor.broker.member import TP
from monitor.broker.outputs import GroupMovedOn, Transactions
from monitor.errors import InfrastructureError
from monitor.records import Output

log = logging.getLogger(__name__)
#: errors that say the group moved on: these partitions are someone else's now
REASSIGNED = frozenset({KafkaError.ILLEGAL_GENERATION, KafkaError.UNKNOWN_MEMBER_ID,
                        KafkaError.REBALANCE_IN_PROGRESS, KafkaError.FENCED_INSTANCE_ID})
#: errors that say another producer with the same transactional id took over
FENCED = frozenset({KafkaError.PRODUCER_FENCED, KafkaError._FENCED, KafkaError.INVALID_PRODUCER_EPOCH})


class RdOutputProducer(Transactions):
    client_errors = (KafkaException,)

    def __init__(self, kafka_config: dict[str, Any], transactional_id: str, *, delivery_timeout_ms: int = 120_000,
                 on_failure: Callable[[str], None] = lambda reason: None):
        """As :class:`~monitor.broker.outputs.OutputProducer`."""
        super().__init__(delivery_timeout_ms, on_failure)
        config = librdkafka_config(kafka_config) | {
            "transactional.id": transactional_id, "enable.idempotence": True, "acks": "all", "linger.ms": 5,
            "message.timeout.ms": delivery_timeout_ms,
            "transaction.timeout.ms": max(60_000, 2 * delivery_timeout_ms), "logger": log,
        }
        try:
            self._producer = Producer(config)
            self._producer.init_transactions(delivery_timeout_ms / 1000)
        except KafkaException as exc:
            raise rd_infrastructure_error("cannot start the transactional output producer", exc) from exc

    def _transact(self, outputs: list[Output], offsets: dict[TP, int], group: Any) -> None:
        undelivered: list[KafkaError] = []

        def delivered(error: KafkaError | None, message: Message) -> None:
            if error is not None:
                undelivered.append(error)

        try:
            self._producer.begin_transaction()
            for out in outputs:
                self._producer.produce(out.topic, out.value, out.key, on_delivery=delivered)
            if offsets:
                self._producer.send_offsets_to_transaction(
                    [TopicPartition(t, p, o) for (t, p), o in offsets.items()], group)
            self._producer.commit_transaction()
        except KafkaException as exc:
            self._failed(exc)
        if undelivered:  # commit_transaction fails first when a record was not delivered
            raise InfrastructureError(f"an output was not delivered: {undelivered[0].str()}", retriable=False)

    def _failed(self, exc: KafkaException) -> None:
        error = error_of(exc)
        code = None if error is None else error.code()
        if code in FENCED:
            self._on_failure("fenced")
            raise InfrastructureError(f"another monitor instance with the same transactional id took over: {exc}",
                                      retriable=False) from exc
        if error is None or error.fatal():
            raise rd_infrastructure_error("the output producer failed for good", exc) from exc
        if code in REASSIGNED:
            self._abort("group_moved", error.name())
            raise GroupMovedOn(error.name()) from exc
        self._abort("aborted", error.name())
        raise InfrastructureError(f"writing outputs failed, transaction aborted: {error.name()}: {error.str()}",
                                  retriable=True) from exc

    def _abort_transaction(self) -> None:
        self._producer.abort_transaction()

    def close(self) -> None:
        self._producer.flush(5)
