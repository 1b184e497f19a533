"""What the service keeps of the poll that brings a rebalance.

The real-broker tests (test_delivery) cover rebalances end to end; the case here, a
rebalance arriving in the same poll as records of a kept partition read from a reset
position, depends on timing the broker cannot be made to produce on demand, so the
consumer is a stand-in recording positions and seeks.
"""

from __future__ import annotations

from monitor.pipeline import Record
from monitor.service import Service
from monitor.settings import Settings


class Consumer:
    def __init__(self, positions):
        self.positions = dict(positions)
        self.seeks = {}

    def forget(self, partitions):
        for tp in partitions:
            self.positions.pop(tp, None)

    def seek(self, positions):
        self.seeks.update(positions)


def test_records_already_processed_are_dropped_and_kept_partitions_never_go_back():
    service = Service(Settings(traces_topic="t", outcomes_topic="o", metrics_port=0))
    a, b, c = ("t", 0), ("t", 1), ("o", 0)
    service._owned = {a, b, c}
    consumer = Consumer({a: 2, b: 0, c: 5})
    polled = [Record("t", 0, 1, None, b"x"), Record("t", 0, 2, None, b"x"), Record("t", 0, 3, None, b"x"),
              Record("t", 1, 0, None, b"x"), Record("t", 2, 7, None, b"x")]
    kept = service._apply_rebalance(consumer, {a, b, c}, {a, b, c}, polled)
    # t/0@1 was processed before the rebalance; t/2 is not this instance's partition
    assert [(r.topic, r.partition, r.offset) for r in kept] == [("t", 0, 2), ("t", 0, 3), ("t", 1, 0)]
    # resume after what is in hand, not at the position reached before this poll
    assert consumer.seeks == {a: 4, b: 1, c: 5}
