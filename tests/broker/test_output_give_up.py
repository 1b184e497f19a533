"""A transaction kafka-python does not finish is given up on after the delivery
timeout: its producer is replaced by a new one with the same transactional id, and the
batch is sent again, unless its commit had been asked for (then the group's committed
offsets say whether it went through). A stand-in replaces kafka-python's producer here:
a real broker cannot be made to leave a transaction unfinished on demand (the rebalance
torture test meets it now and then: send_offsets_to_transaction waiting for good after a
broker restart)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import ClassVar

import pytest

from devstack.wait import wait_for
from monitor.broker import outputs
from monitor.broker.connection import Connection
from monitor.broker.outputs import InDoubt, OutputProducer
from monitor.errors import InfrastructureError
from monitor.protocol.records import Output
from monitor.service.delivery import Delivery
from monitor.service.health import Health

TP = ("traces", 0)
OUT = Output("anomalies", b"k", b"v", source=None)  # type: ignore[arg-type]
SENT = [("anomalies", b"k", b"v", None)]


class Hung(Exception):
    pass


class StandIn:
    """kafka-python's producer as the output producer uses it; ``hang`` names the call
    that never returns on the first instance (the later ones work)."""

    made: ClassVar[list[StandIn]] = []
    hang = "commit_transaction"

    def __init__(self, **config: object):
        self.config = config
        self.sent: list[tuple] = []
        self.committed = False
        self.release = threading.Event()
        self.closed = False
        StandIn.made.append(self)

    def _maybe_hang(self, call: str) -> None:
        if call == StandIn.hang and self is StandIn.made[0]:
            self.release.wait()
            raise Hung(call)

    def init_transactions(self) -> None: ...

    def begin_transaction(self) -> None: ...

    def send(self, topic, key=None, value=None, partition=None):
        self.sent.append((topic, key, value, partition))
        written = SimpleNamespace(topic=topic, partition=0, offset=40 + len(self.sent))
        return SimpleNamespace(get=lambda timeout=None: written)

    def send_offsets_to_transaction(self, offsets, group) -> None:
        self._maybe_hang("send_offsets_to_transaction")

    def flush(self, timeout=None) -> None: ...

    def commit_transaction(self) -> None:
        self._maybe_hang("commit_transaction")
        self.committed = True

    def abort_transaction(self) -> None: ...

    def close(self, timeout=None) -> None:
        self.closed = True
        self.release.set()


@pytest.fixture
def stand_in(monkeypatch):
    StandIn.made = []
    monkeypatch.setattr(outputs, "KafkaProducer", StandIn)
    return StandIn


def producer(failures: list[str]) -> OutputProducer:
    return OutputProducer(Connection("127.0.0.1:9"), "txn", delivery_timeout_ms=200,
                          on_failure=failures.append)


def test_a_transaction_never_finished_before_its_commit_is_given_up_and_sent_on_a_new_producer(stand_in):
    stand_in.hang = "send_offsets_to_transaction"
    failures: list[str] = []
    out = producer(failures)
    batch = [OUT]
    with pytest.raises(InfrastructureError, match="did not finish") as raised:
        out.commit(batch, {TP: 5}, group="g")
    assert raised.value.retriable and not isinstance(raised.value, InDoubt)  # nothing can have committed
    assert "stalled" in failures
    first = stand_in.made[0]
    wait_for(lambda: first.closed, timeout=10, what="the producer given up on closed (on a thread of its own)")
    out.commit(batch, {TP: 5}, group="g")  # the next attempt: a new producer
    assert len(stand_in.made) == 2 and stand_in.made[1].committed and stand_in.made[1].sent == SENT


def test_a_commit_given_up_on_is_in_doubt(stand_in):
    stand_in.hang = "commit_transaction"
    out = producer([])
    with pytest.raises(InDoubt):
        out.commit([OUT], {TP: 5}, group="g")
    out.start()
    assert len(stand_in.made) == 2


class Group:
    """The consumer's side of a delivery: its group metadata and committed offsets."""

    def __init__(self, committed: dict):
        self._committed = committed
        self.asked = 0

    def group_metadata(self):
        return "g"

    def committed(self, partitions):
        self.asked += 1
        return {tp: self._committed.get(tp, 0) for tp in partitions}


@pytest.mark.parametrize("went_through", [True, False])
def test_delivery_asks_the_group_whether_a_transaction_in_doubt_committed(stand_in, went_through):
    """In doubt, the group's committed offsets decide: the batch's offsets there, it went
    through (sending it again would double its outputs); otherwise it is sent again."""
    stand_in.hang = "commit_transaction"
    group = Group({TP: 5} if went_through else {TP: 2})
    delivery = Delivery(producer([]), group, pipeline=None, assignment=None, metrics=None, health=Health(),
                        stopping=threading.Event(), save_state=lambda: None)
    batch = SimpleNamespace(outputs=[OUT])
    delivery._commit(batch, {TP: 5})
    assert group.asked == 1
    assert len(stand_in.made) == 2  # a new producer either way, up before the group was asked
    assert stand_in.made[1].sent == ([] if went_through else SENT)
    assert stand_in.made[1].committed is (not went_through)


@pytest.mark.parametrize("went_through", [True, False])
def test_a_transaction_in_doubt_without_offsets_is_told_by_its_first_record(stand_in, monkeypatch, went_through):
    """A batch of timer outputs only (an incident closing, a request's outcome window
    closing) commits no offsets: in doubt, whether its first record is committed decides
    (it was sent again whatever happened, and written twice when it had gone through)."""
    stand_in.hang = "commit_transaction"
    asked = []

    def is_committed(connection, topic, partition, offset):
        asked.append((topic, partition, offset, len(stand_in.made)))
        return went_through

    monkeypatch.setattr(outputs, "is_committed", is_committed)
    group = Group({})
    delivery = Delivery(producer([]), group, pipeline=None, assignment=None, metrics=None, health=Health(),
                        stopping=threading.Event(), save_state=lambda: None)
    delivery._commit(SimpleNamespace(outputs=[OUT, OUT]), {})
    assert asked == [("anomalies", 0, 41, 2)]  # the first record, asked once a new producer ended its transaction
    assert group.asked == 0
    assert stand_in.made[1].sent == ([] if went_through else SENT * 2)
    assert stand_in.made[1].committed is (not went_through)
