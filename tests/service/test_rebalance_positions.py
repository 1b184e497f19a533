"""What the service keeps of the poll that brings a rebalance.

The real-broker tests (test_delivery) cover rebalances end to end; the case here, a
rebalance arriving in the same poll as records of a kept partition read from a reset
position, depends on timing the broker cannot be made to produce on demand, so the
consumer is a stand-in recording positions and seeks. The last test needs no broker at
all: it checks the offsets batches carry to their commit.
"""

from __future__ import annotations

from monitor.codec import Limits
from monitor.core.detect import DetectorConfig
from monitor.pipeline import Record
from monitor.runner import StageRunner, StageSpec
from monitor.service import Service
from monitor.settings import Settings
from tests.factories import KEYRING, SCOPES


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


def test_each_batch_carries_the_progress_of_every_batch_before_it():
    """With several batches in flight, a batch's positions and commits include what
    earlier batches reached on partitions it has no records of; a snapshot taken when
    it was polled would take those partitions back."""
    service = Service(Settings(traces_topic="t", outcomes_topic="o", metrics_port=0, stage_process=False))
    service.runner = StageRunner(StageSpec(KEYRING, SCOPES, Limits(), DetectorConfig(), 1000), processes=0)
    try:
        first = [Record("o", 0, 0, None, b"{}"), Record("o", 0, 1, None, b"{}")]
        second = [Record("o", 1, 5, None, b"{}")]
        service._process(first, [])
        batch = service._process(second, [])
    finally:
        service.runner.close()
    assert batch.positions == {("o", 0): 2, ("o", 1): 6}
    assert batch.committable == {("o", 0): 2, ("o", 1): 6}
