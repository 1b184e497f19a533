"""The judge: de-duplication and the detector, in the service's own process, one chunk
after the other in submission order.

Observers (a thread, or child processes) measure chunks in any order and at their own
pace; the detector's references depend on the order of the traces, so the judge takes
each chunk's observations only once every chunk and command submitted before it is
done. Commands on the judge's state (forget, remember, decisions, state) are queued in
the same order, so the detector sees exactly the sequence one in-process measurer
would. It runs in its own thread, so no child's results reader ever waits for it.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

from monitor.errors import MeasuringFailed
from monitor.measuring.child import STOP_TIMEOUT_S, Command, execute
from monitor.measuring.measurer import Measurer


class Judge:
    def __init__(self, measurer: Measurer):
        self._measurer = measurer
        self._queue: deque[tuple[list[Future[Any]], Command, tuple[Any, ...], Future[Any]]] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="measuring-judge", daemon=True)
        self._thread.start()

    def judge(self, observed: Future[Any]) -> Future[Any]:
        """The results of a chunk, once it is observed and everything before it judged."""
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

    def check(self) -> None:
        if self._failure is not None:
            raise MeasuringFailed(f"judging measured chunks failed: {self._failure}")

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(STOP_TIMEOUT_S)

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

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
                result.set_result(execute(self._measurer, command, args))
            except Exception as exc:  # a bug, not a record: the service stops at its next check()
                self._failure = exc
                result.set_exception(MeasuringFailed(f"judging failed: {type(exc).__name__}: {exc}"))
