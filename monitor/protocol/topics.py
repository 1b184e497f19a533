"""The monitor's topics: their default names and how they are laid out. The one home of
both: settings, the producer, ``attention-monitor topics create``, ``make kafka`` and
``docker-compose.yml`` (which runs that command) all take them from here.

Traces and outcomes are keyed by request id and must have the same partition count, so
a trace and its outcome land on the same partition number and meet in one instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: room for a 16 MiB trace record plus its header, matching the monitor's record limit
TRACE_RECORD_BYTES = 16 * 1024 * 1024 + 64 * 1024


@dataclass(frozen=True)
class Topics:
    traces: str = "attention-traces"
    outcomes: str = "task-outcomes"
    contracts: str = "attention-contracts"
    anomalies: str = "attention-anomalies"
    dead_letter: str = "attention-dead-letter"
    references: str = "attention-references"
    #: internal: measured traces on their way to the instance that judges their stream
    #: (:mod:`monitor.protocol.observations`)
    observations: str = "attention-observations"
    #: internal: the judges' state, so that it follows a moved observations partition
    #: (compacted; partition *i* holds the state of the keys of observations partition *i*)
    judge_state: str = "attention-judge-state"
    #: internal: requests awaiting their outcome past the join, so that a late outcome is
    #: attributed whoever owns its partition then (partition *i* holds trace partition
    #: *i*'s; :mod:`monitor.protocol.pending`)
    pending: str = "attention-pending-outcomes"


DEFAULT = Topics()


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    configs: dict[str, str] = field(default_factory=dict)


#: how long an outcome is attributed by default (``OUTCOME_WINDOW_S``): 3 days
OUTCOME_WINDOW_S = 3 * 24 * 3600.0


def layout(topics: Topics = DEFAULT, partitions: int = 12, outcome_window_s: float = OUTCOME_WINDOW_S
           ) -> list[TopicSpec]:
    """Every topic the monitor reads or writes, as it should be created. ``partitions``
    bounds how many instances share the work (traces, outcomes, anomalies and the
    observations, keyed by judge, get that many; the contracts and references topics are
    one compacted partition each, read in full by everyone). The pending outcomes keep
    their records a day longer than ``outcome_window_s`` (``OUTCOME_WINDOW_S``)."""
    if partitions < 1:
        raise ValueError("partitions must be at least 1")
    return [
        TopicSpec(topics.traces, partitions, {"max.message.bytes": str(TRACE_RECORD_BYTES)}),
        TopicSpec(topics.outcomes, partitions),
        TopicSpec(topics.contracts, 1, {"cleanup.policy": "compact"}),
        TopicSpec(topics.references, 1, {"cleanup.policy": "compact"}),
        TopicSpec(topics.anomalies, partitions),
        TopicSpec(topics.dead_letter, max(1, partitions // 4)),
        TopicSpec(topics.observations, partitions),
        TopicSpec(topics.judge_state, partitions, {"cleanup.policy": "compact",
                                                    "max.message.bytes": str(TRACE_RECORD_BYTES)}),
        TopicSpec(topics.pending, partitions, {"retention.ms": str(int((outcome_window_s + 86400) * 1000))}),
    ]
