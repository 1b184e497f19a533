"""The measuring child process and the commands a measurer takes.

A :class:`Child` is one spawned process running a :class:`~monitor.measuring.measurer.Observer`
(it only observes: see :mod:`monitor.measuring.workers` for how the service feeds one or
several): commands go down one pipe and results come back up another, read by one
thread, in order. A chunk's records arrive either whole or as places in the shared ring
(:class:`Placed`, :mod:`monitor.measuring.ring`), read there without a copy: where the
values are is a property of the chunk, not of the command. The child ignores SIGINT and
SIGTERM (the service stops it after the last batch) and leaves when its request pipe
closes, which also happens when the service dies by ``kill -9``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing
import signal
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from multiprocessing.connection import Connection
from typing import Any

from monitor.errors import MeasuringFailed
from monitor.measuring import ring as ring_module
from monitor.measuring.measurer import Measurer, MeasurerSpec, Observer
from monitor.measuring.tuning import collect_less, reuse_freed_memory
from monitor.protocol.records import Record

log = logging.getLogger(__name__)

#: how long closing waits for the child to leave before it is killed
STOP_TIMEOUT_S = 10.0
#: the results pipe's buffer: a chunk's observations fit, so the child goes on to the
#: next chunk instead of waiting for the service's reader to take them (Linux's default,
#: 64 KiB, holds less than a chunk's)
RESULTS_PIPE_BYTES = 1024 * 1024
@dataclass(frozen=True)
class Placed:
    """A chunk of records whose values sit in the shared ring: topic, partition, offset,
    start and length of each."""

    places: list[tuple[str, int, int, int, int]]

    def records(self, ring: memoryview | None) -> list[Record]:
        """The records, their values views of the ring (no copy)."""
        if ring is None:
            raise ValueError("records placed in a ring, but there is no ring here")
        return [Record(topic, partition, offset, None, ring[start : start + length])
                for topic, partition, offset, start, length in self.places]


#: a chunk of trace records to observe: the records themselves, or their places in the ring
Chunk = list[Record] | Placed


class Command(Enum):
    """What a measurer is asked to do; the arguments are in :func:`execute`."""

    OBSERVE = "observe"  #: (chunk,) → observed (decoded, verified, measured; not judged)
    JUDGE = "judge"  #: (observed,) → results
    JUDGE_FORWARDED = "judge_forwarded"  #: (forwarded entries, again) → verdicts
    KEY_STATES = "key_states"  #: (judge keys,) → their states
    RESTORE = "restore"  #: (judge keys' states,): install them
    SET_CONTRACTS = "set_contracts"  #: (contracts,)
    FORGET = "forget"  #: (trace ids,): let these traces through again
    DECIDE = "decide"  #: (reference decisions,): pins and promotions, in order
    REMEMBER = "remember"  #: (trace ids,): already processed (read back from the outputs)
    STATE = "state"  #: () → the detector's reference state
    PING = "ping"  #: () → None, once everything before it is done
    STOP = "stop"  #: (): the child leaves


#: what an observer (a measuring process, or the thread that stands for one) carries out
OBSERVING = (Command.OBSERVE, Command.SET_CONTRACTS, Command.PING)


def execute(measurer: Observer, command: Command, args: tuple[Any, ...], ring: memoryview | None = None) -> Any:
    """Carry out one command on ``measurer``: an :class:`Observer` carries out those of
    ``OBSERVING``, the judge's :class:`Measurer` every one."""
    if command is Command.OBSERVE:
        chunk = args[0]
        return measurer.observe(chunk.records(ring) if isinstance(chunk, Placed) else chunk)
    if command is Command.SET_CONTRACTS:
        return measurer.set_contracts(args[0])
    if command is Command.PING:
        return None
    if not isinstance(measurer, Measurer):
        raise ValueError(f"{command} is the judge's, not an observer's")
    if command is Command.JUDGE:
        return measurer.judge(args[0])
    if command is Command.JUDGE_FORWARDED:
        return measurer.judge_forwarded(*args)
    if command is Command.KEY_STATES:
        return measurer.key_states(args[0])
    if command is Command.RESTORE:
        return measurer.restore(args[0])
    if command is Command.FORGET:
        return measurer.forget(args[0])
    if command is Command.DECIDE:
        return measurer.decide(args[0])
    if command is Command.REMEMBER:
        return measurer.remember(args[0])
    if command is Command.STATE:
        return measurer.detector.state_dict()
    raise ValueError(f"{command} is not executed by a measurer")


class Child:
    """The spawned measuring process, serving commands one after the other: requests go
    down one pipe, results come back up another, where a thread matches them to the
    futures waiting in order."""

    def __init__(self, spec: MeasurerSpec, ring_path: str):
        ctx = multiprocessing.get_context("spawn")
        requests, self._requests = ctx.Pipe(duplex=False)
        self._results, results_end = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_serve, args=(requests, results_end, spec, ring_path),
                                   name="attention-monitor-measuring", daemon=True)
        self.process.start()
        requests.close()  # only the child holds these ends now: its exit closes them
        results_end.close()
        _widen(self._results)
        self._waiting: deque[Future[Any]] = deque()
        self._send = threading.Lock()
        self._failure: str | None = None
        self._reader = threading.Thread(target=self._read, name="measuring-results", daemon=True)
        self._reader.start()

    def call(self, command: Command, args: tuple[Any, ...]) -> Future[Any]:
        future: Future[Any] = Future()
        with self._send:
            self.check()
            self._waiting.append(future)  # before sending: the reader may answer at once
            try:
                self._requests.send((command, args))
            except OSError as exc:
                self._fail(f"cannot reach it: {exc}")
        return future

    @property
    def in_flight(self) -> int:
        """Commands sent and not yet answered."""
        return len(self._waiting)

    @property
    def pipe_bytes(self) -> int:
        """The results pipe's buffer size (``RESULTS_PIPE_BYTES`` where Linux allows)."""
        return int(fcntl.fcntl(self._results.fileno(), fcntl.F_GETPIPE_SZ))

    def check(self) -> None:
        if self._failure is not None:
            raise MeasuringFailed(f"the measuring process died: {self._failure}")

    def close(self) -> None:
        if self._failure is None:
            with contextlib.suppress(OSError):
                self._requests.send((Command.STOP, ()))
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
            self._waiting.popleft().set_exception(MeasuringFailed(f"the measuring process died: {self._failure}"))


def _widen(pipe: Connection) -> None:
    """Give the pipe a ``RESULTS_PIPE_BYTES`` buffer (Linux); where that is refused, it
    keeps its size and the start log says so."""
    try:
        fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, RESULTS_PIPE_BYTES)
    except (AttributeError, OSError) as exc:  # not Linux, or above /proc/sys/fs/pipe-max-size
        log.info("the measuring results pipe keeps its default size (%s): the measuring process may wait for "
                 "the service to read its results", exc)


def _serve(requests: Connection, results_end: Connection, spec: MeasurerSpec, ring_path: str) -> None:
    """The child's main loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s[measuring]: %(message)s")
    if spec.reuse_freed_memory:
        reuse_freed_memory()
    ring = ring_module.attach(ring_path)
    measurer = spec.observer()  # it only measures: the judge is in the service's process
    collect_less()  # see monitor.measuring.tuning
    while True:
        try:
            command, args = requests.recv()
        except (EOFError, OSError):
            return  # the service is gone
        if command is Command.STOP:
            return
        try:
            reply: tuple[bool, Any] = (True, execute(measurer, command, args, ring))
        except Exception as exc:  # a bug, not a record: the caller's future raises it
            log.exception("measuring command %s failed", command.value)
            reply = (False, RuntimeError(f"measuring command {command.value} failed: {type(exc).__name__}: {exc}"))
        try:
            results_end.send(reply)
        except (OSError, ValueError):
            return
