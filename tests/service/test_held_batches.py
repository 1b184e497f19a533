"""Batches that finish while a rebalance is under way, or after the group refused a
commit (monitor.service.delivery).

Their outputs are written only in the transaction that commits their offsets: held while
the partitions are parked, then committed with the kept partitions' offsets, less what
the new owners of the moved partitions do again from the group's commit. Written at
once without offsets, a judge's anomaly records were written twice whenever the
partition's new owner read the outputs back before that transaction landed (the
rebalance torture test met it: 31 anomaly records doubled in one run of five). When the
new owner reads back is a race the broker cannot be made to lose on demand, so the
transactions asked for are recorded here instead of sent.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from monitor.broker.outputs import GroupMovedOn
from monitor.errors import InfrastructureError
from monitor.protocol.records import Output
from monitor.protocol.topics import Topics
from monitor.service.assignment import Assignment
from monitor.service.batch import Batch
from monitor.service.delivery import Delivery
from monitor.service.exporter import MonitorMetrics
from monitor.service.health import Health

TOPICS = Topics()
TRACES_0, TRACES_1 = (TOPICS.traces, 0), (TOPICS.traces, 1)
JUDGED_0, JUDGED_1 = (TOPICS.observations, 0), (TOPICS.observations, 1)


class Transactions:
    """The output producer's side: each transaction asked for, as (outputs, offsets);
    the next ``refuse`` are refused as the broker refuses a generation the group left."""

    def __init__(self) -> None:
        self.asked: list[tuple[list[str], dict]] = []
        self.refuse = 0

    def commit(self, outputs, offsets, group, waiting=None) -> None:
        if self.refuse:
            self.refuse -= 1
            raise GroupMovedOn("ILLEGAL_GENERATION")
        self.asked.append(([o.value.decode() for o in outputs], dict(offsets)))


def delivery(assignment: Assignment) -> tuple[Delivery, Transactions]:
    transactions = Transactions()
    pipeline = SimpleNamespace(topics=TOPICS, committed=lambda offsets: None)
    consumer = SimpleNamespace(group_metadata=lambda: "generation")
    health = Health()
    health.assigned()
    health.broker_answered()
    return Delivery(transactions, consumer, pipeline, assignment, MonitorMetrics(CollectorRegistry()), health,
                    threading.Event(), save_state=lambda: None), transactions


def output(topic: str, name: str, source: tuple[str, int, int], partition: int | None = None) -> Output:
    return Output(topic, None, name.encode(), source, partition)


def batch() -> Batch:
    """A batch of both judges' partitions and both trace partitions."""
    return Batch([output(TOPICS.anomalies, "finding judged on 0", (*JUDGED_0, 7)),
                  output(TOPICS.anomalies, "finding judged on 1", (*JUDGED_1, 3)),
                  output(TOPICS.judge_state, "state round of 0", (*JUDGED_0, 8), 0),
                  output(TOPICS.dead_letter, "dead letter of traces 0", (*TRACES_0, 4)),
                  output(TOPICS.pending, "pending of traces 0", (TOPICS.pending, 0, -1), 0),
                  output(TOPICS.pending, "pending of traces 1", (TOPICS.pending, 1, -1), 1),
                  output(TOPICS.observations, "forwarded from traces 0", (*TRACES_0, 4)),
                  output(TOPICS.anomalies, "incident closed", ("", -1, -1))],
                 positions={TRACES_0: 5, TRACES_1: 9, JUDGED_0: 8, JUDGED_1: 4},
                 committable={TRACES_0: 5, TRACES_1: 9, JUDGED_0: 8, JUDGED_1: 4})


def test_a_batch_finished_mid_rebalance_is_written_with_its_kept_offsets_less_the_moved_partitions_work():
    owned = {TRACES_0, TRACES_1, JUDGED_0, JUDGED_1}
    assignment = Assignment(owned=set(owned))
    sent, transactions = delivery(assignment)
    assignment.revoke(owned)  # eager: everything revoked; the new assignment not known yet
    sent.complete(batch())
    assert transactions.asked == []  # not written without its offsets
    assert assignment.positions[JUDGED_0] == 8  # yet kept partitions would resume after it

    change = assignment.assign({TRACES_1, JUDGED_1}, [])  # traces 0 and judge 0 went elsewhere
    sent.reassigned(change.lost)
    [(outputs, offsets)] = transactions.asked
    assert offsets == {TRACES_1: 9, JUDGED_1: 4}
    # what the new owner of traces 0 and judge 0 does again from the commit is left to it;
    # a forwarded trace stays (a judge takes a trace forwarded twice once)
    assert outputs == ["finding judged on 1", "pending of traces 1", "forwarded from traces 0", "incident closed"]


def test_held_batches_go_out_in_one_transaction_and_a_rebalance_that_keeps_everything_drops_nothing():
    owned = {TRACES_0, TRACES_1, JUDGED_0, JUDGED_1}
    assignment = Assignment(owned=set(owned))
    sent, transactions = delivery(assignment)
    assignment.revoke(owned)
    sent.complete(batch())
    later = {**batch().committable, TRACES_0: 6}  # a batch carries the offsets of those before it
    sent.complete(Batch([], positions=later, committable=later))
    sent.reassigned(assignment.assign(set(owned), []).lost)
    [(outputs, offsets)] = transactions.asked
    assert len(outputs) == len(batch().outputs)
    assert offsets == {TRACES_0: 6, TRACES_1: 9, JUDGED_0: 8, JUDGED_1: 4}
    sent.complete(Batch([output(TOPICS.anomalies, "after", (*JUDGED_0, 9))], {JUDGED_0: 10}, {JUDGED_0: 10}))
    assert transactions.asked[-1] == (["after"], {JUDGED_0: 10})  # no rebalance: written at once



def test_a_commit_the_group_refuses_is_held_with_what_follows_until_the_new_assignment():
    """An outage let the group move on: the refused batch and the ones after it wait
    for the new assignment, then go out in one transaction, less what the new owner of
    a moved partition does again (it once ended the service, exit code 3, whenever its
    partitions went elsewhere); readiness says why meanwhile."""
    owned = {TRACES_0, TRACES_1, JUDGED_0, JUDGED_1}
    assignment = Assignment(owned=set(owned))
    sent, transactions = delivery(assignment)
    transactions.refuse = 1
    sent.complete(batch())
    later = {**batch().committable, JUDGED_1: 6}
    sent.complete(Batch([output(TOPICS.anomalies, "finding judged on 1, later", (*JUDGED_1, 5))], later, later))
    assert transactions.asked == [] and "ILLEGAL_GENERATION" in sent.health.why_not_ready()
    assignment.revoke(owned)  # the rebalance the refusal announced
    sent.reassigned(assignment.assign({TRACES_1, JUDGED_1}, []).lost)
    [(outputs, offsets)] = transactions.asked
    assert offsets == {TRACES_1: 9, JUDGED_1: 6}
    assert outputs == ["finding judged on 1", "pending of traces 1", "forwarded from traces 0", "incident closed",
                       "finding judged on 1, later"]


def test_no_new_assignment_within_the_rejoin_timeout_of_a_refusal_stops_the_service():
    assignment = Assignment(owned={TRACES_0})
    sent, transactions = delivery(assignment)
    sent.rejoin_timeout_s = -1.0  # already past at the next batch
    transactions.refuse = 1
    sent.complete(batch())
    with pytest.raises(InfrastructureError, match="restarting from the committed offsets") as stopped:
        sent.complete(Batch([], {TRACES_0: 6}, {TRACES_0: 6}))
    assert not stopped.value.retriable and transactions.asked == []
