"""Where measuring runs beside the consumer: a thread, or child processes.

kafka-python's fetching and record parsing and the :class:`~monitor.measuring.measurer.Measurer`
(decode, metrics, detection) are all Python; in one process they take turns on one
interpreter lock, so the service could only ever run at the sum of their costs. A
:class:`MeasuringProcess` runs the measurer in a child (spawned, so it inherits no Kafka
client threads) and the service consumes the next batch while the child measures this
one; a :class:`MeasuringThread` runs it in a thread of the service's own process.

Both take the same :class:`Command` values, executed one after the other in submission
order by a single worker, so the measurer sees exactly the sequence an in-process one
would. Results come back as :mod:`monitor.measuring.measurer` values, never weights.

With several children (``MEASURE_PROCESSES`` > 1), chunks of records are *observed*
(decoded, verified, measured: :meth:`~monitor.measuring.measurer.Measurer.observe`, which depends
on no other record) by the children, each chunk by the one with the fewest in flight,
and *judged* (de-duplication and the detector, about 25 µs a trace) in the service's
own process, by one thread, in submission order: each chunk once it is observed and
every earlier chunk and command is done, so the detector sees exactly the sequence one
process would, and the results are the same. (Judging in the first child instead cost
every observation a second trip through the pipes: 0.15 ms more CPU a trace with two
children on two cores.)

The child talks over two plain pipes, read by one thread on each side; no named
semaphores are involved (``ProcessPoolExecutor`` would create five in /dev/shm, left
behind whenever the service's whole process group is killed). Record values travel
through a :class:`~monitor.measuring.ring.SharedRing`. The child ignores SIGINT and SIGTERM (the
service decides when to stop, and stops it after the last batch); it leaves when its
request pipe closes, which also happens when the service dies by ``kill -9``. If the
child dies, :class:`~monitor.errors.MeasuringFailed` is raised from the next call or
result: nothing was committed for the records in flight, so they are read again after a
restart.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from monitor.errors import MeasuringFailed
from monitor.measuring import ring as ring_module
from monitor.measuring.child import STOP_TIMEOUT_S, Child, Command, Placed, execute
from monitor.measuring.measurer import Measurer, MeasurerSpec, Result
from monitor.protocol.decisions import ReferenceTable
from monitor.protocol.model_contract import ContractTable
from monitor.protocol.records import Record

#: a chunk of trace records measured at once (as a batch): a quarter of the ring, so four
#: chunks are in flight, and large enough that the per-chunk hand-offs (pipes, futures,
#: the judge's turn) do not matter: 64 traces of 129 KiB a chunk, not 16, raised the
#: service bench's rate 13 % with one measuring process and 22 % with two
CHUNK_BYTES = 8 * 1024 * 1024
CHUNK_RECORDS = 64
#: the shared ring that carries record values to the child; a value larger than the
#: ring goes through the pipe instead
RING_BYTES = 32 * 1024 * 1024


class Measuring(Protocol):
    """What the pipeline needs from a thread or process that measures."""

    def submit(self, records: list[Record]) -> list[Future[list[Result]]]:
        """Queue trace records; their results, chunk by chunk, in order."""

    def forget(self, trace_ids: list[str]) -> None:
        """Let these traces through the de-duplication window again."""


def results(futures: list[Future[list[Result]]]) -> Iterator[Result]:
    """The results of submitted chunks, in record order."""
    for future in futures:
        yield from future.result()


def chunks(records: list[Record]) -> Iterator[tuple[list[Record], int]]:
    """Records in chunks of at most ``CHUNK_RECORDS`` and about ``CHUNK_BYTES``, with
    their sizes."""
    chunk: list[Record] = []
    size = 0
    for record in records:
        chunk.append(record)
        size += len(record.value or b"")
        if size >= CHUNK_BYTES or len(chunk) >= CHUNK_RECORDS:
            yield chunk, size
            chunk, size = [], 0
    if chunk:
        yield chunk, size


class _Ordered:
    """Commands go out in order; keeps the contract table's version last sent."""

    _contracts_version = -1
    _decisions_version = 0

    def call(self, command: Command, *args: Any) -> Future[Any]:
        raise NotImplementedError

    def sync_contracts(self, table: ContractTable) -> None:
        """Send the contract table if it changed since the last call."""
        if table.version != self._contracts_version:
            self._contracts_version = table.version
            self.call(Command.SET_CONTRACTS, table.contracts())

    def forget(self, trace_ids: list[str]) -> None:
        if trace_ids:
            self.call(Command.FORGET, trace_ids)

    def remember(self, trace_ids: list[str]) -> None:
        if trace_ids:
            self.call(Command.REMEMBER, trace_ids)

    def sync_decisions(self, table: ReferenceTable) -> None:
        """Send the reference decisions made since the last call."""
        if table.version != self._decisions_version:
            self.call(Command.DECIDE, table.since(self._decisions_version))
            self._decisions_version = table.version

    def state(self) -> Future[dict[str, Any]]:
        """The detector's reference state, after everything submitted so far."""
        return self.call(Command.STATE)

    def ping(self) -> None:
        self.call(Command.PING).result()


class MeasuringThread(_Ordered):
    """The measurer in one worker thread of this process."""

    def __init__(self, spec: MeasurerSpec):
        self._measurer = spec.build()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="measuring")

    def submit(self, records: list[Record]) -> list[Future[list[Result]]]:
        return [self.call(Command.MEASURE, chunk) for chunk, _ in chunks(records)]

    def call(self, command: Command, *args: Any) -> Future[Any]:
        return self._worker.submit(execute, self._measurer, command, args)

    def check(self) -> None:
        """A thread does not die on its own: a failing call raises from its future."""

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)


class MeasuringProcess(_Ordered):
    """The measurer in spawned child processes, fed through one shared ring: with one
    child, it does everything; with more, each chunk goes to the one with the fewest in
    flight and this process judges them, in order (see the module documentation)."""

    def __init__(self, spec: MeasurerSpec, processes: int = 1):
        if processes < 1:
            raise ValueError("at least one measuring process")
        self._ring = ring_module.SharedRing(RING_BYTES)
        self._children: list[Child] = []
        try:
            for _ in range(processes):
                self._children.append(Child(spec, self._ring.path))
            try:
                for child in self._children:  # a child that cannot start fails the service at once
                    child.call(Command.PING, ()).result()
            except BaseException:
                for child in self._children:
                    child.close()
                raise
        finally:
            self._ring.unlink()  # mapped by every process now (or a child never started)
        self._turn = 0
        self._order: _InOrder | None = _InOrder(spec.build()) if processes > 1 else None

    @property
    def pid(self) -> int | None:
        return self._children[0].process.pid

    @property
    def pids(self) -> list[int | None]:
        return [child.process.pid for child in self._children]

    @property
    def ring_path(self) -> str:
        return self._ring.path

    def submit(self, records: list[Record]) -> list[Future[list[Result]]]:
        return [self._send(chunk, size) for chunk, size in chunks(records)]

    @property
    def in_flight(self) -> list[int]:
        """Commands each child has been sent and not yet answered (chunks, mostly)."""
        return [child.in_flight for child in self._children]

    def _send(self, chunk: list[Record], size: int) -> Future[list[Result]]:
        # the child with the fewest chunks in flight, the next in turn among equals: one
        # that gets less of the cores (the broker and this process share them) gets fewer
        # chunks instead of holding the others back (judging keeps record order anyway)
        order = self._children[self._turn :] + self._children[: self._turn]
        child = min(order, key=lambda c: c.in_flight)
        self._turn = (self._children.index(child) + 1) % len(self._children)
        whole, placed_command = ((Command.MEASURE, Command.MEASURE_PLACED) if self._order is None
                                 else (Command.OBSERVE, Command.OBSERVE_PLACED))
        if size > self._ring.size:
            future: Future[Any] = child.call(whole, (chunk,))
        else:
            start = self._ring.reserve(size)
            placed: list[Placed] = []
            for record in chunk:
                value = record.value or b""
                self._ring.buffer[start : start + len(value)] = value
                placed.append((record.topic, record.partition, record.offset, start, len(value)))
                start += len(value)
            future = child.call(placed_command, (placed,))
            self._ring.hold(start - size, start, future)
        return future if self._order is None else self._order.judge(future)

    def call(self, command: Command, *args: Any) -> Future[Any]:
        if self._order is None:
            return self._children[0].call(command, args)
        if command is Command.SET_CONTRACTS:  # every child decodes: each gets them, before later chunks
            for child in self._children[1:]:
                child.call(command, args)
            return self._children[0].call(command, args)
        if command is Command.PING:  # every child, and every chunk judged before
            futures = [child.call(command, args) for child in self._children]
            return self._order.command(Command.PING, (), after=futures)
        return self._order.command(command, args)  # the judge's state: in order with the chunks

    def check(self) -> None:
        """Raise :class:`MeasuringFailed` if a child has died (a flag read: its results
        pipe closing tells at once)."""
        for child in self._children:
            child.check()
        if self._order is not None:
            self._order.check()

    def close(self) -> None:
        if self._order is not None:
            self._order.close()
        for child in self._children:
            child.close()
        self._ring.close()


class _InOrder:
    """Judges each chunk's observations (once observed) and carries out each command on
    the judging measurer, in submission order, from its own thread (so no child's
    results reader ever waits for the detector)."""

    def __init__(self, judge: Measurer):
        self._judge = judge
        self._queue: deque[tuple[list[Future[Any]], Command, tuple[Any, ...], Future[Any]]] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="measuring-judge", daemon=True)
        self._thread.start()

    def judge(self, observed: Future[Any]) -> Future[Any]:
        return self.command(Command.JUDGE, (), after=[observed])

    def command(self, command: Command, args: tuple[Any, ...], after: list[Future[Any]] | None = None) -> Future[Any]:
        """``command`` once everything submitted before it is done, and ``after`` too
        (a chunk to judge: its observations are the argument)."""
        result: Future[Any] = Future()
        with self._wake:
            self._queue.append((after or [], command, args, result))
            self._wake.notify()
        for future in after or []:
            future.add_done_callback(lambda _: self._notify())
        return result

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def check(self) -> None:
        if self._failure is not None:
            raise MeasuringFailed(f"judging measured chunks failed: {self._failure}")

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(STOP_TIMEOUT_S)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not (self._queue and all(f.done() for f in self._queue[0][0])):
                    self._wake.wait()
                if self._closed:
                    return
                after, command, args, result = self._queue.popleft()
            error = next((f.exception() for f in after if f.exception() is not None), None)
            if error is not None:
                result.set_exception(error)
                continue
            if command is Command.JUDGE:
                args = (after[0].result(),)
            try:
                result.set_result(execute(self._judge, command, args))
            except Exception as exc:  # a bug, not a record: the service stops at its next check()
                self._failure = exc
                result.set_exception(MeasuringFailed(f"judging failed: {type(exc).__name__}: {exc}"))


def start_measuring(spec: MeasurerSpec, processes: int) -> MeasuringThread | MeasuringProcess:
    """``processes`` 0: a thread of this process; 1 or more: child processes."""
    if processes == 0:
        return MeasuringThread(spec)
    if processes >= 1:
        return MeasuringProcess(spec, processes)
    raise ValueError(f"measuring processes must be 0 (a thread) or more (child processes), got {processes}")
