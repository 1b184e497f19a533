"""Requests awaiting their outcome past the join: attributed once, bounded, rebuilt from
what was written."""

from __future__ import annotations

import random

import pytest

from monitor.core.pending import Delta, PendingOutcomes


def test_a_late_outcome_settles_its_request_once_with_every_layer():
    table = PendingOutcomes(window=100, max_requests=10)
    for layer in (0, 1, 1, 2):
        assert table.add("r1", "m", "canary", "healthy", layer, partition=3, at=5.0) == []
    entry = table.settle("r1")
    assert entry is not None
    assert (entry.model_id, entry.revision, entry.judged_by, entry.layers, entry.partition, entry.deadline) == \
        ("m", "canary", "healthy", (0, 1, 2), 3, 105.0)
    assert table.settle("r1") is None  # a second outcome finds nothing: never counted twice
    assert table.settle("never-traced") is None
    assert len(table) == 0 and table.evictions == {"window": 0, "capacity": 0}


def test_the_window_closes_on_event_time_and_capacity_pushes_the_oldest_out():
    table = PendingOutcomes(window=10, max_requests=2)
    table.add("a", "m", "r", "r", 0, 0, at=0.0)
    table.add("b", "m", "r", "r", 0, 0, at=1.0)
    pushed = table.add("c", "m", "r", "r", 0, 0, at=2.0)
    assert [p.request_id for p in pushed] == ["a"]
    assert table.expire(10.9) == []
    assert [p.request_id for p in table.expire(11.0)] == ["b"]
    assert table.evictions == {"window": 1, "capacity": 1} and "c" in table and "a" not in table


def test_deltas_rebuild_the_table_after_any_sequence_of_events():
    """What a new owner of the partitions rebuilds from the written deltas equals the
    table that wrote them, whatever the order of traces, outcomes and windows closing
    (closed windows are not listed: each delta says through when they closed)."""
    rng = random.Random(11)
    table = PendingOutcomes(window=50, max_requests=40)
    written: list[Delta] = []
    now = 0.0
    for step in range(3000):
        now += rng.random()
        number = rng.randrange(120)
        request = f"r{number}"
        if rng.random() < 0.6:
            table.add(request, "m", f"rev{rng.randrange(3)}", "rev0", rng.randrange(4), number % 3,
                      now - 10 * rng.random())  # read a little out of order
        else:
            table.settle(request)
        if step % rng.choice((1, 7, 50)) == 0:
            table.expire(now)
            written += [d for _, d in sorted(table.take_deltas(now).items())]
    table.expire(now)
    written += [d for _, d in sorted(table.take_deltas(now).items())]
    rebuilt = PendingOutcomes(window=50, max_requests=40)
    for delta in written:
        rebuilt.apply(delta)
    rebuilt.forget(max(d.through for d in written))
    mine = {r: (e.layers, e.partition, e.at, e.revision) for r, e in table._requests.items()}
    theirs = {r: (e.layers, e.partition, e.at, e.revision) for r, e in rebuilt._requests.items()}
    assert theirs == mine and len(mine) > 5
    assert table.evictions["window"] > 50 and table.evictions["capacity"] > 5
    assert rebuilt.take_deltas(now) == {}  # rebuilding writes nothing


def test_a_request_written_then_settled_is_said_closed_and_one_never_written_is_not():
    table = PendingOutcomes(window=50, max_requests=10)
    table.add("old", "m", "r", "r", 0, 1, at=0.0)
    table.take_deltas(0.0)
    table.add("new", "m", "r", "r", 0, 1, at=1.0)
    table.add("old", "m", "r", "r", 1, 1, at=2.0)  # another layer: its whole entry again
    table.settle("old")
    table.settle("new")
    assert table.take_deltas(3.0) == {1: Delta({}, ["old"], through=3.0)}


def test_dropping_partitions_forgets_their_requests_and_unwritten_changes():
    table = PendingOutcomes(window=50, max_requests=10)
    table.add("a", "m", "r", "r", 0, 0, at=0.0)
    table.add("b", "m", "r", "r", 0, 1, at=0.0)
    assert [e.request_id for e in table.drop_partitions([1])] == ["b"]
    assert "b" not in table and list(table.take_deltas(0.0)) == [0]


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="positive"):
        PendingOutcomes(window=0, max_requests=1)


def test_deltas_travel_as_records_and_rebuild_the_same_table():
    from monitor.errors import TraceRejected
    from monitor.protocol import pending

    table = PendingOutcomes(window=50, max_requests=20_000)
    for n in range(12_000):
        table.add(f"r{n}", "m", "canary" if n % 2 else "healthy", "healthy", n % 3, 4, at=float(n) / 100)
    first = table.take_deltas(0.0)[4]
    for n in range(0, 12_000, 2):
        table.settle(f"r{n}")
    table.add("r0", "m", "healthy", "healthy", 1, 4, at=130.0)  # settled, then traced again
    assert len(table.expire(60.0)) == 500  # r1 .. r999 (odd) closed by 60 s: not listed
    second = table.take_deltas(60.0)[4]
    values = [*pending.encode(first), *pending.encode(second)]
    assert len(values) == 3 + 2 + 1 and all(len(v) < 1024 * 1024 for v in values)
    rebuilt = PendingOutcomes(window=50, max_requests=20_000)
    for value in values:
        rebuilt.apply(pending.decode(value, 4))
    assert rebuilt.forget(60.0) == 500
    assert {r: (e.layers, e.revision, e.at) for r, e in rebuilt._requests.items()} == \
        {r: (e.layers, e.revision, e.at) for r, e in table._requests.items()}
    assert rebuilt.settle("r1001").deadline == pytest.approx(60.01) and rebuilt.settle("r0").layers == (1,)
    (quiet,) = pending.encode(Delta(expired=3, through=70.0))  # windows closed, nothing else
    assert pending.decode(quiet, 4).through == 70.0
    with pytest.raises(TraceRejected, match="pending outcomes record"):
        pending.decode(b'{"schema": "attention-pending/1", "opened": [["m"]], "closed": []}', 4)
