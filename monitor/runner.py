"""Runs the trace stage beside the consumer: in a child process, or in a thread.

kafka-python's fetching and record parsing and the trace stage (decode, metrics,
detection) are all Python; in one process they take turns on one interpreter lock, so
the service could only ever run at the sum of their costs. With ``processes=1`` the
stage runs in a child process (spawned, so it inherits no Kafka client threads) and the
service consumes the next batch while the child measures this one.

Work goes to the stage in submission order: chunks of trace records, contract table
updates, de-duplication releases and state requests are executed one after the other
by a single worker, so the stage sees exactly the sequence an in-process stage would.
Results come back as :mod:`monitor.stage` values, never weights.

The child ignores SIGINT and SIGTERM (the service decides when to stop, and stops it
after the last batch), and it exits when the service's end of its pipe closes, also
after a ``kill -9`` of the service. If the child dies, :class:`StageFailed` is raised
from the results: nothing was committed for the records in flight, so they are read
again after a restart.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from monitor.access import Keyring, ScopePolicy
from monitor.codec import Limits
from monitor.core.detect import Detector, DetectorConfig
from monitor.model_contract import ContractTable
from monitor.stage import Record, Result, TraceStage

log = logging.getLogger(__name__)

#: a chunk of trace records sent to the stage at once: small enough to keep the
#: pipe's copies small, large enough that the per-task overhead does not matter
CHUNK_BYTES = 4 * 1024 * 1024
CHUNK_RECORDS = 64


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
        self._executor: Executor
        if processes:
            self._executor = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_child_init, initargs=(spec,))
        else:
            self._local = spec.build()
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="stage")
        self._contracts_version = -1
        self.ping()  # start the worker now: a stage that cannot start fails the service at once

    def submit(self, records: list[Record]) -> list[Future[list[Result]]]:
        """Queue trace records; their results, chunk by chunk, in order."""
        futures, chunk, size = [], [], 0
        for record in records:
            chunk.append(record)
            size += len(record.value or b"")
            if size >= CHUNK_BYTES or len(chunk) >= CHUNK_RECORDS:
                futures.append(self._call("run_many", chunk))
                chunk, size = [], 0
        if chunk:
            futures.append(self._call("run_many", chunk))
        return futures

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
        result: dict[str, Any] = self.wait(self.state_future())
        return result

    def state_future(self) -> Future[dict[str, Any]]:
        return self._call("state")

    def ping(self) -> None:
        self.wait(self._call("ping"))

    @staticmethod
    def wait(future: Future[Any]) -> Any:
        try:
            return future.result()
        except BrokenProcessPool as exc:
            raise StageFailed(f"the measuring process died: {exc}") from exc

    def results(self, futures: list[Future[list[Result]]]) -> Iterator[Result]:
        for future in futures:
            yield from self.wait(future)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _call(self, method: str, *args: Any) -> Future[Any]:
        try:
            if self._local is not None:
                return self._executor.submit(_call, self._local, method, *args)
            return self._executor.submit(_child_call, method, *args)
        except BrokenProcessPool as exc:
            raise StageFailed(f"the measuring process died: {exc}") from exc


# --- in the worker ---------------------------------------------------------------------

_STAGE: TraceStage | None = None


def _child_init(spec: StageSpec) -> None:
    global _STAGE
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s[stage]: %(message)s")
    _STAGE = spec.build()


def _child_call(method: str, *args: Any) -> Any:
    assert _STAGE is not None, "the stage process was not initialised"
    return _call(_STAGE, method, *args)


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

