"""Where measuring runs beside the consumer: observers, and the judge.

Measuring a chunk of trace records is two steps (:mod:`monitor.measuring.measurer`).
*Observing* (decode, verify, metrics) depends on nothing but the record and the model
contracts; it runs in observers, each chunk in the one with the fewest chunks in flight.
*Judging* (de-duplication and the detector) depends on the order of the traces; it runs
in one thread of the service's own process (:class:`~monitor.measuring.judge.Judge`),
chunk after chunk in submission order, so the results are those of one in-process
measurer whatever the observers.

The observers are child processes (``MEASURE_PROCESSES``, by default one per core;
:class:`ProcessObservers`), or with ``MEASURE_PROCESSES=0`` a thread of the service's
own process (:class:`ThreadObserver`), which then takes turns with the consumer on one
interpreter lock. Results come back as :mod:`monitor.measuring.measurer` values, never
weights.

Children are spawned (they inherit no Kafka client threads) and talk over two plain
pipes, read by one thread on each side; no named semaphores are involved
(``ProcessPoolExecutor`` would create them in /dev/shm, left behind whenever the
service's whole process group is killed). Record values travel through a
:class:`~monitor.measuring.ring.SharedRing`, each region freed as its chunk finishes.
If a child dies, :class:`~monitor.errors.MeasuringFailed` is raised from the next call
or result: nothing was committed for the records in flight, so they are read again
after a restart.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from monitor.core.detect import Verdict
from monitor.core.key_state import KeyState
from monitor.measuring import ring as ring_module
from monitor.measuring.child import Child, Chunk, Command, Placed, execute
from monitor.measuring.judge import Judge
from monitor.measuring.measurer import Duplicate, MeasurerSpec, Rejected, Result
from monitor.protocol.decisions import ReferenceTable
from monitor.protocol.model_contract import ContractTable, ModelContract
from monitor.protocol.observations import Forwarded
from monitor.protocol.records import Record

#: a chunk of trace records measured at once (as a batch): a quarter of the ring, so four
#: chunks are in flight, and large enough that the per-chunk hand-offs (pipes, futures,
#: the judge's turn) do not matter (docs/performance.md)
CHUNK_BYTES = 8 * 1024 * 1024
CHUNK_RECORDS = 64
#: the shared ring that carries record values to the children; a value larger than the
#: ring goes through the pipe instead
RING_BYTES = 32 * 1024 * 1024


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


class ThreadObserver:
    """Observes in one worker thread of this process, in submission order."""

    def __init__(self, spec: MeasurerSpec):
        self._measurer = spec.observer()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="measuring")

    def observe(self, chunk: list[Record], size: int) -> Future[Any]:
        return self.call(Command.OBSERVE, (chunk,))

    def call(self, command: Command, args: tuple[Any, ...]) -> Future[Any]:
        return self._worker.submit(execute, self._measurer, command, args)

    def broadcast(self, command: Command, args: tuple[Any, ...]) -> list[Future[Any]]:
        return [self.call(command, args)]

    def check(self) -> None:
        """A thread does not die on its own: a failing call raises from its future."""

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)


class ProcessObservers:
    """Spawned child processes, fed through one shared ring; each chunk goes to the one
    with the fewest chunks in flight."""

    def __init__(self, spec: MeasurerSpec, processes: int):
        self._ring = ring_module.SharedRing(RING_BYTES)
        self.children: list[Child] = []
        try:
            for _ in range(processes):
                self.children.append(Child(spec, self._ring.path))
            try:
                for child in self.children:  # a child that cannot start fails the service at once
                    child.call(Command.PING, ()).result()
            except BaseException:
                for child in self.children:
                    child.close()
                raise
        finally:
            self._ring.unlink()  # mapped by every process now (or a child never started)
        self._turn = 0

    @property
    def ring_path(self) -> str:
        return self._ring.path

    def observe(self, chunk: list[Record], size: int) -> Future[Any]:
        # the child with the fewest chunks in flight, the next in turn among equals: one
        # that gets less of the cores (the broker and this process share them) gets fewer
        # chunks instead of holding the others back (the judge keeps record order anyway)
        order = self.children[self._turn :] + self.children[: self._turn]
        child = min(order, key=lambda c: c.in_flight)
        self._turn = (self.children.index(child) + 1) % len(self.children)
        if size > self._ring.size:
            return child.call(Command.OBSERVE, (chunk,))
        start = self._ring.reserve(size)
        places = []
        for record in chunk:
            value = record.value or b""
            self._ring.buffer[start : start + len(value)] = value
            places.append((record.topic, record.partition, record.offset, start, len(value)))
            start += len(value)
        placed: Chunk = Placed(places)
        future = child.call(Command.OBSERVE, (placed,))
        self._ring.hold(start - size, start, future)
        return future

    def broadcast(self, command: Command, args: tuple[Any, ...]) -> list[Future[Any]]:
        return [child.call(command, args) for child in self.children]

    def check(self) -> None:
        """Raise :class:`MeasuringFailed` if a child has died (a flag read: its results
        pipe closing tells at once)."""
        for child in self.children:
            child.check()

    def close(self) -> None:
        for child in self.children:
            child.close()
        self._ring.close()


class Measuring:
    """Observers and the judge, behind the verbs the service and the pipeline use.
    ``processes`` 0: observing in a thread of this process; 1 or more: in that many
    child processes."""

    def __init__(self, spec: MeasurerSpec, processes: int):
        if processes < 0:
            raise ValueError(f"measuring processes must be 0 (a thread) or more (child processes), got {processes}")
        self.observers: ThreadObserver | ProcessObservers = (
            ThreadObserver(spec) if processes == 0 else ProcessObservers(spec, processes))
        self.spec = spec
        self._judge = Judge(spec.build())
        self._contracts_version = -1
        self._decisions_version = 0

    def submit(self, records: list[Record]) -> list[Future[list[Result]]]:
        """Queue trace records; their results, chunk by chunk, in order."""
        return [self._judge.judge(self.observers.observe(chunk, size)) for chunk, size in chunks(records)]

    def judge_forwarded(self, entries: list[Forwarded], again: bool = False
                        ) -> Future[list[Verdict | Duplicate | Rejected]]:
        """Queue traces measured elsewhere for the judge, in order with everything else
        it is given; their verdicts (``again``: see :meth:`Measurer.judge_forwarded`)."""
        return self._judge.command(Command.JUDGE_FORWARDED, (entries, again))

    def key_states(self, keys: list[tuple[str, str]]) -> Future[list[KeyState]]:
        """The state of these judge keys once everything queued before is judged."""
        return self._judge.command(Command.KEY_STATES, (keys,))

    def restore(self, states: list[KeyState]) -> Future[None]:
        """Install judge keys' states before anything queued after."""
        return self._judge.command(Command.RESTORE, (states,))

    def sync_contracts(self, table: ContractTable) -> None:
        """Send the contract table to every observer if it changed since the last call
        (in order with the chunks: a chunk submitted later is decoded with it)."""
        if table.version != self._contracts_version:
            self._contracts_version = table.version
            self.set_contracts(table.contracts())

    def set_contracts(self, contracts: list[ModelContract]) -> None:
        self.observers.broadcast(Command.SET_CONTRACTS, (contracts,))

    def sync_decisions(self, table: ReferenceTable) -> None:
        """Send the reference decisions made since the last call to the judge."""
        if table.version != self._decisions_version:
            self._judge.command(Command.DECIDE, (table.since(self._decisions_version),))
            self._decisions_version = table.version

    def forget(self, trace_ids: list[str]) -> None:
        """Let these traces through the de-duplication window again."""
        if trace_ids:
            self._judge.command(Command.FORGET, (trace_ids,))

    def remember(self, trace_ids: list[str]) -> None:
        """Treat these traces as processed already."""
        if trace_ids:
            self._judge.command(Command.REMEMBER, (trace_ids,))

    def state(self) -> Future[dict[str, Any]]:
        """The detector's reference state, after everything submitted so far."""
        return self._judge.command(Command.STATE, ())

    def ping(self) -> None:
        """Return once every observer and the judge have done everything before."""
        self._judge.command(Command.PING, (), after=self.observers.broadcast(Command.PING, ())).result()

    def check(self) -> None:
        """Raise :class:`MeasuringFailed` if an observer or the judge has failed."""
        self.observers.check()
        self._judge.check()

    @property
    def pids(self) -> list[int | None]:
        """The child processes' ids (none when observing in a thread)."""
        if isinstance(self.observers, ProcessObservers):
            return [child.process.pid for child in self.observers.children]
        return []

    @property
    def in_flight(self) -> list[int]:
        """Commands each child has been sent and not yet answered (chunks, mostly)."""
        if isinstance(self.observers, ProcessObservers):
            return [child.in_flight for child in self.observers.children]
        return []

    def close(self) -> None:
        self._judge.close()
        self.observers.close()

