from __future__ import annotations

import random

from monitor.core.join import JoinBuffer, RecentKeys


def test_trace_then_outcome_and_outcome_then_trace():
    buf: JoinBuffer[str] = JoinBuffer(ttl=10, max_entries=100)
    assert buf.add_trace("r1", "t1", partition=0, offset=5, now=0) == []
    joined = buf.add_outcome("r1", "failure", partition=0, offset=7, now=1)
    assert [(j.item, j.outcome, j.offset) for j in joined] == [("t1", "failure", 5)]
    assert buf.add_outcome("r2", "success", partition=1, offset=3, now=2) == []
    joined = buf.add_trace("r2", "t2", partition=1, offset=9, now=3)
    assert [(j.item, j.outcome) for j in joined] == [("t2", "success")]
    # A second layer of the same request meets the outcome too.
    assert [j.item for j in buf.add_trace("r2", "t2-layer2", 1, 10, now=4)] == ["t2-layer2"]


def test_ttl_gives_missing_and_counts_evictions():
    buf: JoinBuffer[str] = JoinBuffer(ttl=10, max_entries=100)
    buf.add_trace("r1", "t1", 0, 1, now=0)
    buf.add_outcome("r9", "success", 0, 2, now=0)
    assert buf.expire(now=9.9) == []
    joined = buf.expire(now=10)
    assert [(j.item, j.outcome) for j in joined] == [("t1", "missing")]
    assert len(buf) == 0 and buf.evictions == {"ttl": 2, "capacity": 0}


def test_capacity_evicts_the_oldest():
    buf: JoinBuffer[str] = JoinBuffer(ttl=100, max_entries=2)
    buf.add_trace("a", "ta", 0, 1, now=0)
    buf.add_trace("b", "tb", 0, 2, now=1)
    out = buf.add_trace("c", "tc", 0, 3, now=2)
    assert [(j.item, j.outcome) for j in out] == [("ta", "missing")]
    assert len(buf) == 2 and buf.evictions["capacity"] == 1


def test_oldest_offsets_and_dropping_partitions():
    buf: JoinBuffer[str] = JoinBuffer(ttl=100, max_entries=100)
    buf.add_trace("a", "ta", 0, 7, now=0)
    buf.add_trace("b", "tb", 0, 4, now=0)
    buf.add_trace("c", "tc", 1, 9, now=0)
    buf.add_outcome("z", "success", 1, 11, now=0)
    assert buf.oldest_offsets() == ({0: 4, 1: 9}, {1: 11})
    assert sorted(buf.drop_partitions([0])) == ["ta", "tb"]
    assert buf.oldest_offsets() == ({1: 9}, {1: 11})
    assert [j.item for j in buf.add_outcome("c", "failure", 1, 12, now=1)] == ["tc"]


def test_recent_keys_is_a_bounded_window():
    seen = RecentKeys(3)
    assert [seen.add(k) for k in "abca"] == [True, True, True, False]
    seen.add("d")
    seen.add("e")
    assert "b" not in seen and "a" in seen and len(seen) == 3


def test_oldest_offsets_match_a_scan_of_what_is_waiting_through_any_sequence_of_events():
    rng = random.Random(7)
    buf: JoinBuffer[str] = JoinBuffer(ttl=5, max_entries=40)
    now, next_offset = 0.0, {p: 0 for p in range(3)}
    for step in range(3000):
        now += rng.random() * 0.2
        partition = rng.randrange(3)
        offset = next_offset[partition] = next_offset[partition] + rng.randrange(1, 3)
        request = f"r{rng.randrange(60)}"
        action = rng.random()
        if action < 0.5:
            buf.add_trace(request, f"t{step}", partition, offset, now)
        elif action < 0.85:
            buf.add_outcome(request, "success", partition, offset, now)
        elif action < 0.95:
            buf.expire(now)
        else:
            buf.drop_partitions([partition])
        scan: tuple[dict[int, int], dict[int, int]] = ({}, {})
        for kind, partition, offset in buf.waiting():
            table = scan[0] if kind == "trace" else scan[1]
            table[partition] = min(offset, table.get(partition, offset))
        assert buf.oldest_offsets() == scan, step


def test_outcomes_that_meet_no_trace_are_counted_once_and_any_outcome_value_travels():
    buf: JoinBuffer[str] = JoinBuffer(ttl=10, max_entries=100, left_without=("pending", ""))
    buf.add_outcome("never-traced", ("failure", "thumbs_down"), 0, 1, now=0)
    buf.add_outcome("taken", ("success", ""), 0, 2, now=0, met=True)  # settled elsewhere (a late outcome)
    buf.add_trace("r", "t", 0, 3, now=0)
    assert [j.outcome for j in buf.add_outcome("r", ("failure", "regenerate"), 0, 4, now=1)] == [
        ("failure", "regenerate")]
    buf.add_outcome("r", ("failure", "again"), 0, 5, now=2)  # a duplicate replaces it, and meets nothing
    buf.add_trace("late-trace", "t2", 0, 6, now=3)
    assert [(j.item, j.outcome) for j in buf.expire(now=100)] == [("t2", ("pending", ""))]
    assert buf.unmatched == 2
