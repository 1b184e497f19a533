"""What one batch of records leaves to do once the pipeline accounted for it: the
outputs to write and the offsets they allow to commit, together (``service/delivery.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from monitor.protocol.records import Output
from monitor.protocol.topics import Topics

__all__ = ["Batch"]

TP = tuple[str, int]


@dataclass(frozen=True)
class Batch:
    """What one batch of records leaves to do."""

    outputs: list[Output]
    positions: dict[TP, int]  #: next offset to read of every partition, after this batch
    committable: dict[TP, int]  #: safe to commit with the outputs
    taught: bool = False  #: a trace of the batch taught a reference (save the state before committing)

    @staticmethod
    def merged(batches: list[Batch]) -> Batch:
        """Consecutive batches as one (each carries the offsets of every batch before it,
        so the last one's positions and committable offsets are theirs)."""
        if len(batches) == 1:
            return batches[0]
        return Batch([o for b in batches for o in b.outputs], batches[-1].positions, batches[-1].committable,
                     any(b.taught for b in batches))

    def without(self, lost: set[TP], topics: Topics) -> Batch:
        """This batch as its instance may still write it once a rebalance moved the
        partitions ``lost`` elsewhere: what their new owner does again from the group's
        commit is left out (a judge's outputs, dead letters and the pending outcomes'
        changes of those partitions: written here too, they would be written twice). The
        observation records it forwards stay: one may carry traces of partitions kept as
        well, and a judge forwarded a trace twice judges it once."""
        def redone(out: Output) -> bool:
            topic, partition, _ = out.source
            if topic == topics.pending:
                topic = topics.traces  # a trace partition's requests awaiting their outcome
            return out.topic != topics.observations and (topic, partition) in lost

        return Batch([o for o in self.outputs if not redone(o)], self.positions, self.committable, self.taught)
