"""What a completed rebalance keeps of the poll that brought it (monitor.service.assignment).

The real-broker tests (test_delivery) cover rebalances end to end; the case here, a
rebalance arriving in the same poll as records of a kept partition read from a reset
position, depends on timing the broker cannot be made to produce on demand, so it is
checked on the assignment logic itself.
"""

from __future__ import annotations

from monitor.protocol.records import Record
from monitor.service.assignment import Assignment


def test_records_already_processed_are_dropped_and_kept_partitions_never_go_back():
    a, b, c = ("t", 0), ("t", 1), ("o", 0)
    assignment = Assignment(owned={a, b, c})
    assignment.reached({a: 2, b: 0, c: 5, ("t", 2): 9})  # t/2 is not this instance's: not recorded
    assert assignment.positions == {a: 2, b: 0, c: 5}
    assignment.revoke({a, b, c})
    assignment.reached({a: 2})  # a batch completing while parked still records where it reached
    assert assignment.committing == set()  # parked: nothing committed until the new assignment
    polled = [Record("t", 0, 1, None, b"x"), Record("t", 0, 2, None, b"x"), Record("t", 0, 3, None, b"x"),
              Record("t", 1, 0, None, b"x"), Record("t", 2, 7, None, b"x")]
    change = assignment.assign({a, b, c}, polled)
    # t/0@1 was processed before the rebalance; t/2 is not this instance's partition
    assert [(r.topic, r.partition, r.offset) for r in change.records] == [("t", 0, 2), ("t", 0, 3), ("t", 1, 0)]
    # resume after what is in hand, not at the position reached before this poll
    assert change.resume == {a: 4, b: 1, c: 5}
    assert (change.kept, change.lost, change.new) == ({a, b, c}, set(), set())
    assert assignment.committing == {a, b, c}


def test_partitions_that_went_elsewhere_are_lost_and_new_ones_start_from_the_commit():
    a, b = ("t", 0), ("t", 1)
    assignment = Assignment(owned={a})
    assignment.reached({a: 3})
    assignment.revoke({a})
    change = assignment.assign({b}, [Record("t", 1, 9, None, b"x")])
    assert (change.lost, change.kept, change.new) == ({a}, set(), {b})
    assert change.resume == {}  # b resumes from the group's commit, not a position of ours
    assert [r.offset for r in change.records] == [9]
    assert assignment.owned == {b} and assignment.committing == {b}
    assert assignment.positions == {}  # a's position went with it


def test_lag_counts_from_where_processing_reached():
    a, b = ("t", 0), ("t", 1)
    assignment = Assignment(owned={a, b})
    assignment.reached({a: 40})
    assert assignment.lag({a: 100, b: 7}) == 60  # b: nothing processed yet, nothing known
    assignment.reached({a: 100, b: 2})
    assert assignment.lag({a: 100, b: 7}) == 5
