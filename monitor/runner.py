"""Runs the trace stage beside the consumer: in a child process, or in a thread.

kafka-python's fetching and record parsing and the trace stage (decode, metrics,
detection) are all Python; in one process they take turns on one interpreter lock, so
the service could only ever run at the sum of their costs. With ``processes=1`` the
stage runs in a child process (spawned, so it inherits no Kafka client threads) and the
service consumes the next batch while the child measures this one.

Record values travel through a shared ring buffer, not the pipe: the service copies
each value in once and the child reads it in place. (Pickling them through the pipe
made the child fault in fresh pages for every record, which cost more than decoding
it.) The ring is a file in /dev/shm, unlinked as soon as the child has mapped it, so
nothing is left behind whatever way the processes end.

Work goes to the stage in submission order: chunks of trace records, contract table
updates, de-duplication releases and state requests are executed one after the other
by a single worker, so the stage sees exactly the sequence an in-process stage would.
Results come back as :mod:`monitor.stage` values, never weights.

Calls and results travel over two plain pipes, read by one thread on each side; no
named semaphores are involved (``ProcessPoolExecutor`` would create five in /dev/shm,
left behind whenever the service's whole process group is killed).

The child ignores SIGINT and SIGTERM (the service decides when to stop, and stops it
after the last batch); it leaves when its request pipe closes, which also happens when
the service dies by ``kill -9``. If the child dies, :class:`StageFailed` is raised from
the next call or result: nothing was committed for the records in flight, so they are
read again after a restart.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import multiprocessing
import os
import signal
import tempfile
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from monitor.access import Keyring, ScopePolicy
from monitor.codec import Limits
from monitor.core.detect import Detector, DetectorConfig
from monitor.memory import reuse_freed_memory
from monitor.model_contract import ContractTable
from monitor.stage import Record, Result, TraceStage

log = logging.getLogger(__name__)

#: a chunk of trace records sent to the stage at once (and measured as a batch): small
#: enough that the ring holds many chunks in flight, large enough that the per-task
#: overhead does not matter
CHUNK_BYTES = 2 * 1024 * 1024
CHUNK_RECORDS = 64
#: the shared ring that carries record values to the child; a value larger than the
#: ring goes through the pipe instead
RING_BYTES = 32 * 1024 * 1024
#: how long closing waits for the child to leave before it is killed
STOP_TIMEOUT_S = 10.0
#: a record in the ring: topic, partition, offset, start, length
Placed = tuple[str, int, int, int, int]


class StageFailed(RuntimeError):
    """The process running the trace stage died."""


@dataclass(frozen=True)
class StageSpec:
    """Everything needed to build the stage; picklable, so a child can build its own."""

    keyring: Keyring
    scopes: ScopePolicy
    limits: Limits
    detector: DetectorConfig
    dedupe_window: int
    state: Mapping[str, Any] | None = None  #: detector reference state to start from
    log_level: int = logging.INFO
    reuse_freed_memory: bool = True  #: see :mod:`monitor.memory`

    def build(self) -> TraceStage:
        detector = Detector(self.detector)
        if self.state is not None:
            detector.merge_state(self.state)
        return TraceStage(keyring=self.keyring, scopes=self.scopes, contracts=ContractTable(), detector=detector,
                          limits=self.limits, dedupe_window=self.dedupe_window)


class StageRunner:
    def __init__(self, spec: StageSpec, processes: int = 1):
        if processes not in (0, 1):
            raise ValueError(f"processes must be 0 (a thread) or 1 (a child process), got {processes}")
        self._local: TraceStage | None = None
        self._ring: _Ring | None = None
        self._child: _Child | None = None
        self._thread: ThreadPoolExecutor | None = None
        if processes:
            self._ring = _Ring(RING_BYTES)
            try:
                self._child = _Child(spec, self._ring.path)
            except BaseException:
                self._ring.unlink()
                raise
        else:
            self._local = spec.build()
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="stage")
        self._contracts_version = -1
        try:
            self.ping()  # start the worker now: a stage that cannot start fails the service at once
        finally:
            if self._ring is not None:
                self._ring.unlink()  # mapped by both processes now (or the child never started)

    @property
    def child_pid(self) -> int | None:
        """The measuring process's pid (None when the stage runs in a thread)."""
        return None if self._child is None else self._child.process.pid

    @property
    def ring_path(self) -> str | None:
        return None if self._ring is None else self._ring.path

    def submit(self, records: list[Record]) -> list[Future[list[Result]]]:
        """Queue trace records; their results, chunk by chunk, in order."""
        futures, chunk, size = [], [], 0
        for record in records:
            chunk.append(record)
            size += len(record.value or b"")
            if size >= CHUNK_BYTES or len(chunk) >= CHUNK_RECORDS:
                futures.append(self._send(chunk, size))
                chunk, size = [], 0
        if chunk:
            futures.append(self._send(chunk, size))
        return futures

    def _send(self, chunk: list[Record], size: int) -> Future[list[Result]]:
        if self._ring is None or size > self._ring.size:
            return self._call("run_many", chunk)
        start = self._ring.reserve(size)
        placed: list[Placed] = []
        for record in chunk:
            value = record.value or b""
            self._ring.buffer[start : start + len(value)] = value
            placed.append((record.topic, record.partition, record.offset, start, len(value)))
            start += len(value)
        future: Future[list[Result]] = self._call("run_placed", placed)
        self._ring.hold(start - size, start, future)
        return future

    def sync_contracts(self, table: ContractTable) -> None:
        """Send the contract table if it changed since the last call."""
        if table.version != self._contracts_version:
            self._contracts_version = table.version
            self._call("set_contracts", table.contracts())

    def forget(self, trace_ids: list[str]) -> None:
        if trace_ids:
            self._call("forget", trace_ids)

    def state(self) -> dict[str, Any]:
        """The detector's reference state, after everything submitted so far."""
        result: dict[str, Any] = self.state_future().result()
        return result

    def state_future(self) -> Future[dict[str, Any]]:
        return self._call("state")

    def ping(self) -> None:
        self._call("ping").result()

    def check(self) -> None:
        """Raise :class:`StageFailed` if the measuring process has died (a flag read: its
        results pipe closing tells at once)."""
        if self._child is not None:
            self._child.check()

    def results(self, futures: list[Future[list[Result]]]) -> Iterator[Result]:
        for future in futures:
            yield from future.result()

    def close(self) -> None:
        if self._child is not None:
            self._child.close()
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
        if self._ring is not None:
            self._ring.close()

    def _call(self, method: str, *args: Any) -> Future[Any]:
        if self._child is not None:
            return self._child.call(method, args)
        assert self._thread is not None and self._local is not None
        return self._thread.submit(_call, self._local, method, *args)


class _Child:
    """The spawned measuring process, serving calls one after the other: requests go
    down one pipe, results come back up another, where a thread matches them to the
    futures waiting in order."""

    def __init__(self, spec: StageSpec, ring_path: str):
        ctx = multiprocessing.get_context("spawn")
        requests, self._requests = ctx.Pipe(duplex=False)
        self._results, results = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_serve, args=(requests, results, spec, ring_path),
                                   name="attention-monitor-stage", daemon=True)
        self.process.start()
        requests.close()  # only the child holds these ends now: its exit closes them
        results.close()
        self._waiting: deque[Future[Any]] = deque()
        self._send = threading.Lock()
        self._failure: str | None = None
        self._reader = threading.Thread(target=self._read, name="stage-results", daemon=True)
        self._reader.start()

    def call(self, method: str, args: tuple[Any, ...]) -> Future[Any]:
        future: Future[Any] = Future()
        with self._send:
            self.check()
            self._waiting.append(future)  # before sending: the reader may answer at once
            try:
                self._requests.send((method, args))
            except OSError as exc:
                self._fail(f"cannot reach it: {exc}")
        return future

    def check(self) -> None:
        if self._failure is not None:
            raise StageFailed(f"the measuring process died: {self._failure}")

    def close(self) -> None:
        if self._failure is None:
            with contextlib.suppress(OSError):
                self._requests.send(("stop", ()))
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._requests.close()
        self._reader.join(STOP_TIMEOUT_S)
        self._results.close()

    def _read(self) -> None:
        while True:
            try:
                ok, value = self._results.recv()
            except (EOFError, OSError):
                self.process.join(1.0)
                self._fail(f"exit code {self.process.exitcode}")
                return
            future = self._waiting.popleft()
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

    def _fail(self, why: str) -> None:
        if self._failure is None:
            self._failure = why
        while self._waiting:
            self._waiting.popleft().set_exception(StageFailed(f"the measuring process died: {self._failure}"))


class _Ring:
    """Regions of a shared file mapping, handed out in order and reused once the chunk
    that holds them is done. Only the thread that submits uses it."""

    def __init__(self, size: int):
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="attention-monitor-ring-", dir=folder)
        try:
            # Reserve the pages now: a full tmpfs must fail here, with a message, not
            # with SIGBUS at the first write into the mapping.
            os.posix_fallocate(fd, 0, size)
            self.buffer = mmap.mmap(fd, size)
        except OSError as exc:
            os.unlink(self.path)
            raise StageFailed(f"cannot reserve {size} bytes for the shared ring in "
                              f"{folder or tempfile.gettempdir()}: {exc}") from exc
        finally:
            os.close(fd)
        self.size = size
        self._next = 0
        self._held: deque[tuple[int, int, Future[Any]]] = deque()

    def reserve(self, n: int) -> int:
        """A start offset with ``n`` free bytes after it; waits for the oldest chunk
        still in flight when the ring is full (back-pressure from a busy child)."""
        while True:
            while self._held and self._held[0][2].done():
                self._held.popleft()
            for start in (self._next, 0):
                end = start + n
                if end <= self.size and all(e <= start or end <= b for b, e, _ in self._held):
                    return start
            self._held[0][2].result()

    def hold(self, start: int, end: int, future: Future[Any]) -> None:
        self._held.append((start, end, future))
        self._next = end

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        self._held.clear()
        self.buffer.close()


# --- in the measuring process ----------------------------------------------------------


def _serve(requests: Connection, results: Connection, spec: StageSpec, ring_path: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s[stage]: %(message)s")
    if spec.reuse_freed_memory:
        reuse_freed_memory()
    with open(ring_path, "r+b") as f:
        ring = memoryview(mmap.mmap(f.fileno(), 0))
    stage = spec.build()
    while True:
        try:
            method, args = requests.recv()
        except (EOFError, OSError):
            return  # the service is gone
        if method == "stop":
            return
        try:
            if method == "run_placed":
                value = stage.run_many([Record(topic, partition, offset, None, ring[start : start + length])
                                        for topic, partition, offset, start, length in args[0]])
            else:
                value = _call(stage, method, *args)
            reply: tuple[bool, Any] = (True, value)
        except Exception as exc:  # a bug, not a record: the caller's future raises it
            log.exception("stage call %s failed", method)
            reply = (False, RuntimeError(f"stage call {method} failed: {type(exc).__name__}: {exc}"))
        try:
            results.send(reply)
        except (OSError, ValueError):
            return


def _call(stage: TraceStage, method: str, *args: Any) -> Any:
    if method == "run_many":
        return stage.run_many(*args)
    if method == "set_contracts":
        return stage.set_contracts(*args)
    if method == "forget":
        return stage.forget(*args)
    if method == "state":
        return stage.detector.state_dict()
    if method == "ping":
        return None
    raise ValueError(f"unknown stage call {method!r}")
