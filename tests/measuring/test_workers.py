"""Measuring in a child process: same results as in a thread, ring reuse, failure and
cleanup. (The service tests run it against the real broker.)"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import monitor.measuring.workers as measuring_module
from devstack.wait import wait_for
from monitor.core.detect import DetectorConfig
from monitor.errors import MeasuringFailed, RejectReason
from monitor.measuring.child import RESULTS_PIPE_BYTES
from monitor.measuring.measurer import Duplicate, Measured, MeasurerSpec, Rejected
from monitor.measuring.workers import Measuring, results
from monitor.protocol.codec import Limits
from monitor.protocol.model_contract import ContractTable
from monitor.protocol.observations import Forwarded
from monitor.protocol.records import Record
from tests.factories import CONTRACT, KEYRING, SCOPES, make_record

ROOT = Path(__file__).resolve().parents[2]


def spec(**kwargs) -> MeasurerSpec:
    return MeasurerSpec(KEYRING, SCOPES, Limits(), DetectorConfig(reference_traces=5), 1000, **kwargs)


def table() -> ContractTable:
    t = ContractTable()
    t.add(CONTRACT)
    return t


def records(n: int, start: int = 0, **kwargs) -> list[Record]:
    return [Record("traces", i % 3, i, b"k", make_record(i, **kwargs)) for i in range(start, start + n)]


def run(measuring: Measuring, batch: list[Record]) -> list:
    return list(results(measuring.submit(batch)))


@pytest.fixture
def child():
    r = Measuring(spec(), processes=1)
    yield r
    r.close()


def judged(measuring: Measuring, results: list) -> list:
    """The measured traces judged, as their judge receives them once joined."""
    entries = [Forwarded(r.identity, r.heads, r.metrics, "success") for r in results if isinstance(r, Measured)]
    return measuring.judge_forwarded(entries).result()


def comparable(result):
    if isinstance(result, Measured):
        m = result.metrics
        return ("measured", result.identity, m.entropy.tolist(), m.concentration.tolist(), m.sink_share.tolist(),
                float(m.diversity), float(m.effective_heads), [a.kind for a in result.anomalies])
    if isinstance(result, Rejected):
        return ("rejected", result.reason)
    return ("duplicate", result.trace_id)


def test_the_child_process_gives_what_a_thread_gives(child):
    local = Measuring(spec(), processes=0)
    try:
        fresh = records(30)
        batch = fresh + fresh[:2] + [Record("traces", 0, 99, None, b"not a trace")]
        for r in (child, local):
            r.sync_contracts(table())
        ours, theirs = run(child, batch), run(local, batch)
    finally:
        local.close()
    assert [comparable(r) for r in ours] == [comparable(r) for r in theirs]
    kinds = [type(r) for r in ours]
    assert kinds == [Measured] * 30 + [Duplicate] * 2 + [Rejected]
    assert ours[-1].reason is RejectReason.MALFORMED


def test_a_chunks_results_fit_in_the_results_pipe(child):
    """The child must not wait for the service's reader to take a chunk's results."""
    child.sync_contracts(table())
    batch = records(measuring_module.CHUNK_RECORDS)
    measured = run(child, batch)
    local = spec().build()
    local.set_contracts(table().contracts())
    observed = local.observe(records(measuring_module.CHUNK_RECORDS, start=1000))
    largest = max(len(pickle.dumps((True, value))) for value in (measured, observed))
    pipe = child.observers.children[0].pipe_bytes
    assert pipe == RESULTS_PIPE_BYTES > 64 * 1024
    assert largest < pipe


def test_contracts_reach_the_child_when_the_table_changes(child):
    assert run(child, records(1))[0].reason is RejectReason.UNKNOWN_CONTRACT
    child.sync_contracts(table())
    assert isinstance(run(child, records(1, start=1))[0], Measured)


def test_forgotten_traces_are_measured_again(child):
    child.sync_contracts(table())
    batch = records(1)
    first = run(child, batch)[0]
    assert isinstance(first, Measured)
    assert isinstance(run(child, batch)[0], Duplicate)
    child.forget([first.identity.trace_id])
    assert isinstance(run(child, batch)[0], Measured)


def test_the_reference_state_comes_back_from_the_child(child):
    child.sync_contracts(table())
    judged(child, run(child, records(8)))
    state = child.state().result()
    # one layer; its reference learnt from the first reference_traces (5) traces only
    assert [item["reference"]["traces"] for item in state["references"]] == [5]


def test_the_ring_is_reused_without_overwriting_chunks_in_flight(monkeypatch):
    size = len(make_record(0))
    monkeypatch.setattr(measuring_module, "RING_BYTES", 5 * size)
    monkeypatch.setattr(measuring_module, "CHUNK_RECORDS", 2)
    r = Measuring(spec(), processes=1)
    try:
        r.sync_contracts(table())
        batch = records(60)
        results = run(r, batch)  # 30 chunks through a ring that holds 5 records
    finally:
        r.close()
    assert all(isinstance(x, Measured) for x in results), {comparable(x)[:2] for x in results}
    assert [x.identity.source[2] for x in results] == list(range(60))


def test_a_record_larger_than_the_ring_goes_through_the_pipe(monkeypatch):
    monkeypatch.setattr(measuring_module, "RING_BYTES", 1024)
    r = Measuring(spec(), processes=1)
    try:
        r.sync_contracts(table())
        results = run(r, records(3))
    finally:
        r.close()
    assert [type(x) for x in results] == [Measured] * 3


def test_the_child_ignores_sigint_and_a_dead_child_is_reported(child):
    (pid,) = child.pids
    assert pid is not None
    os.kill(pid, signal.SIGINT)  # a Ctrl-C in the terminal reaches the whole process group
    child.ping()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(MeasuringFailed, match="measuring process died"):
        run(child, records(1))  # a chunk in flight, or one sent after: its results say so
    with pytest.raises(MeasuringFailed, match="measuring process died"):
        child.check()  # and so does the service's check between polls


def test_the_child_goes_and_nothing_stays_in_dev_shm_when_the_service_is_killed():
    script = textwrap.dedent("""
        import sys, time
        from tests.measuring.test_workers import spec
        from monitor.measuring.workers import Measuring
        r = Measuring(spec(), processes=1)
        print(r.pids[0], r.observers.ring_path, flush=True)
        time.sleep(600)
    """)
    shm = Path("/dev/shm")
    before = set(shm.iterdir()) if shm.is_dir() else set()
    # A new session, killed as a whole group: as systemd or a terminal would kill it
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line = proc.stdout.readline().split()
        assert len(line) == 2, line
        pid, ring = int(line[0]), line[1]
        assert not os.path.exists(ring)  # unlinked once the child had mapped it
        assert _alive(pid)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    wait_for(lambda: not _alive(pid), timeout=20, what="the measuring process gone")
    after = set(shm.iterdir()) if shm.is_dir() else set()
    assert after - before == set()  # no semaphore, no ring left behind


def test_the_child_leaves_when_only_the_service_is_killed():
    script = textwrap.dedent("""
        import sys, time
        from tests.measuring.test_workers import spec
        from monitor.measuring.workers import Measuring
        r = Measuring(spec(), processes=1)
        print(r.pids[0], flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        assert _alive(pid)
    finally:
        proc.kill()
        proc.wait()
    wait_for(lambda: not _alive(pid), timeout=20, what="the measuring process to leave after its parent died")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_measuring_needs_a_known_mode():
    with pytest.raises(ValueError, match="processes must be 0"):
        Measuring(spec(), processes=-1)


def test_a_ring_that_cannot_be_reserved_is_a_clear_failure():
    # A file size limit below the ring's size makes the reservation fail for real, as a
    # full /dev/shm would (Python ignores SIGXFSZ, so the call fails with EFBIG).
    script = textwrap.dedent("""
        import resource
        from monitor.errors import MeasuringFailed
        from monitor.measuring.workers import Measuring
        from tests.measuring.test_workers import spec
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            Measuring(spec(), processes=1)
        except MeasuringFailed as exc:
            print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "cannot reserve 33554432 bytes for the shared ring" in out.stdout, out.stdout + out.stderr


def test_several_processes_give_what_one_gives_in_the_same_order(monkeypatch):
    """Three children observe chunks in turn and the judge takes them in order: with
    commands between the chunks (forget, remember, decisions), results and the
    detector's state equal those of one measurer."""
    monkeypatch.setattr(measuring_module, "CHUNK_RECORDS", 3)  # many chunks, every child several
    many = Measuring(spec(), processes=3)
    one = Measuring(spec(), processes=0)
    try:
        assert len(set(many.pids)) == 3
        first, second = records(40), records(20, start=40)
        outputs = []
        for m in (many, one):
            m.sync_contracts(table())
            out = run(m, first)
            verdicts = judged(m, out)
            m.forget([r.identity.trace_id for r in out[:4]])  # these may come again
            m.remember([r.identity.trace_id for r in run(m, second[:5])])
            more = run(m, first[:6] + second + [Record("traces", 1, 999, None, b"junk")])
            out += more
            verdicts += judged(m, more)
            outputs.append((out, verdicts, m.state().result()))
        (ours, our_verdicts, our_state), (theirs, their_verdicts, their_state) = outputs
        assert [comparable(r) for r in ours] == [comparable(r) for r in theirs]
        def readiness(verdicts):
            return [getattr(v, "reference_traces", type(v).__name__) for v in verdicts]

        assert readiness(our_verdicts) == readiness(their_verdicts)
        assert readiness(our_verdicts)[:6] == [1, 2, 3, 4, 5, 5] and "Duplicate" in readiness(our_verdicts)
        kinds = [type(r).__name__ for r in ours]
        assert kinds[:40] == ["Measured"] * 40
        assert kinds[40:] == ["Measured"] * 4 + ["Duplicate"] * 2 + ["Duplicate"] * 5 + ["Measured"] * 15 + \
            ["Rejected"]
        assert our_state == their_state
    finally:
        many.close()
        one.close()


def test_a_child_held_back_costs_the_others_no_chunks(monkeypatch):
    """One child stopped with a chunk in the ring: the other takes every chunk after it,
    through the ring's other regions; once the first goes on, the results are those of
    one measurer, in order. (Chunks in turn, or the ring freed oldest first, would stop
    every submit behind the stopped child's chunk.)"""
    size = len(make_record(0))
    monkeypatch.setattr(measuring_module, "RING_BYTES", 6 * size)  # three chunks of two records
    monkeypatch.setattr(measuring_module, "CHUNK_RECORDS", 2)
    many = Measuring(spec(), processes=2)
    one = Measuring(spec(), processes=0)
    stopped = many.pids[1]
    try:
        for m in (many, one):
            m.sync_contracts(table())
        many.ping()
        os.kill(stopped, signal.SIGSTOP)
        batch = records(40)
        submitted: list = []
        feeder = threading.Thread(target=lambda: submitted.extend(many.submit(batch)), daemon=True)
        feeder.start()
        feeder.join(30)
        assert not feeder.is_alive(), "submitting waited for the stopped child"
        wait_for(lambda: many.in_flight[0] == 0, timeout=30, what="the running child through its chunks")
        held = many.in_flight[1]
        assert 1 <= held <= 2, many.in_flight  # at most the ring's share it got before it looked busy
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        got = list(results(submitted))
        assert [comparable(r) for r in got] == [comparable(r) for r in run(one, batch)]
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        many.close()
        one.close()


def test_a_dead_child_among_several_fails_the_service_clearly():
    many = Measuring(spec(), processes=2)
    try:
        os.kill(many.pids[1], signal.SIGKILL)
        wait_for(lambda: _raises(many.check), timeout=10, what="the death noticed")
        with pytest.raises(MeasuringFailed, match="measuring process died"):
            many.check()
    finally:
        many.close()


def _raises(call) -> bool:
    try:
        call()
    except MeasuringFailed:
        return True
    return False
