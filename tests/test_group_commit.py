"""Batches done share one transaction while traces flow (monitor.delivery.GroupCommit)."""

from __future__ import annotations

import time
from typing import cast

from monitor.delivery import Delivery, GroupCommit
from monitor.pipeline import Batch
from monitor.records import Output


class Transactions:
    """Stands in for Delivery: records what each transaction would commit."""

    def __init__(self) -> None:
        self.committed: list[Batch] = []

    def complete(self, batch: Batch) -> None:
        self.committed.append(batch)


def batch(offset: int, taught: bool = False) -> Batch:
    output = Output("attention-anomalies", f"k{offset}".encode(), b"{}", ("attention-traces", 0, offset))
    return Batch([output], {("attention-traces", 0): offset + 1}, {("attention-traces", 0): offset + 1}, taught)


def group(interval: float) -> tuple[GroupCommit, Transactions]:
    transactions = Transactions()
    return GroupCommit(cast(Delivery, transactions), interval), transactions


def test_batches_done_within_the_interval_share_one_transaction_with_the_last_offsets() -> None:
    commits, transactions = group(60.0)
    for offset in range(5):
        commits.add(batch(offset, taught=offset == 2))
        commits.commit_due(idle=False)
    assert transactions.committed == []
    commits.commit_due(idle=True)  # nothing more came: commit at once
    [one] = transactions.committed
    assert [o.key for o in one.outputs] == [f"k{i}".encode() for i in range(5)]
    assert one.committable == {("attention-traces", 0): 5} and one.taught


def test_the_oldest_batch_waits_no_longer_than_the_interval() -> None:
    commits, transactions = group(0.05)
    commits.add(batch(0))
    deadline = time.monotonic() + 5
    while not transactions.committed and time.monotonic() < deadline:
        commits.add(batch(len(transactions.committed) + 1))
        commits.commit_due(idle=False)
    assert transactions.committed, "the interval passed and nothing was committed"
    assert transactions.committed[0].outputs[0].key == b"k0"


def test_commit_takes_the_waiting_batches_before_the_later_ones_and_an_interval_of_zero_commits_each() -> None:
    commits, transactions = group(60.0)
    commits.add(batch(0))
    commits.commit([batch(1), batch(2)])
    assert [[o.key for o in b.outputs] for b in transactions.committed] == [[b"k0", b"k1", b"k2"]]
    commits.commit([])
    assert len(transactions.committed) == 1  # nothing waiting: no empty transaction
    each, separate = group(0.0)
    for offset in range(3):
        each.add(batch(offset))
        each.commit_due(idle=False)
    assert len(separate.committed) == 3


