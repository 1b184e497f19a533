"""Rebalance torture, short (the long one: ``benchmarks/rebalance_torture.py``): three
instances while healthy traffic and a collapsed canary pinned to the healthy revision
flow; one joins, one leaves, the one that judges the canary is killed (kill -9) while a
joining instance has the group rebalancing, and the broker restarts (killed: a graceful
stop of the one-node broker can lose transactions it said were committed, see the long
version's docstring). Against one
undisturbed instance on the same records: no anomaly record lost, none doubled (by trace
id and kind), one incident for the fault, the first finding within one request.

Found on its first runs: a broker restart while a new owner read the pending outcomes
of its partitions stopped that instance (exit 3: librdkafka flags a leader-epoch error
as not retriable, and nothing retried the reads of a reassignment; now those codes are
retriable, monitor.broker.errors.TRANSIENT, and every read of a reassignment is retried
while the broker is away), and an output transaction that kafka-python never finished
after the restart hung its instance for good, its open transaction keeping every reader
of the canary's observations partition (its new judge among them) from reading past it
(seen again in one run of three: send_offsets_to_transaction waiting for good; now a
transaction not finished after the delivery timeout is given up on, its producer
replaced by a new one whose initialisation aborts it: monitor.broker.outputs).

About a minute or two on two loaded cores."""

from __future__ import annotations

import pytest

from benchmarks.rebalance_torture import report, run

pytestmark = [pytest.mark.kafka, pytest.mark.faults]


def test_joins_leaves_a_killed_judge_and_a_broker_restart_lose_and_double_no_finding(tmp_path):
    figures = run(tmp_path, requests=96, rounds=1, instances=3, rate=8.0)
    calm, stormy = figures.undisturbed, figures.disturbed
    explained = report(figures)
    assert calm.findings and calm.first is not None, explained  # the undisturbed run finds the canary
    assert stormy.converged, explained
    assert not figures.lost and not figures.doubled and not figures.unexpected, explained
    assert set(calm.findings.values()) == {1}, explained  # the reference run writes each finding once too
    assert len(calm.opened) == 1 and len(stormy.opened) == 1, explained  # one incident for the fault
    assert len(stormy.incidents) == 1, explained  # its records all name that one incident
    assert stormy.first is not None and abs(stormy.first - calm.first) <= 1, explained
    assert calm.dead_letters == stormy.dead_letters == 0, explained
    # the disturbance happened as meant: the judge killed mid-rebalance, every other instance left cleanly
    assert any("the judge, killed (-9) with the group" in e for e in stormy.events), explained
    assert sorted(stormy.exits.values()) == [-9] + [0] * (len(stormy.exits) - 1), explained
