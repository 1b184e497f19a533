"""Whether the service can do its work, for ``/readyz``.

Ready means: the group has given this instance its assignment (possibly empty), the
broker answered within ``stale_s`` seconds, and the last commit did not fail. During a
broker outage, before the first assignment and while commits fail, ``/readyz`` says 503
and the log says why.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Health:
    def __init__(self, stale_s: float = 15.0, clock: Callable[[], float] = time.monotonic):
        self.stale_s = stale_s
        self._clock = clock
        self._lock = threading.Lock()
        self._assigned = False
        self._broker_at: float | None = None
        self._broker_down_since: float | None = None
        self._commit_failing: str | None = None

    def assigned(self, value: bool = True) -> None:
        with self._lock:
            self._assigned = value

    def broker_answered(self) -> None:
        with self._lock:
            if self._broker_down_since is not None:
                log.info("the broker answers again after %.0f s", self._clock() - self._broker_down_since)
            self._broker_at, self._broker_down_since = self._clock(), None

    def broker_silent(self, why: str) -> None:
        with self._lock:
            if self._broker_down_since is None:
                self._broker_down_since = self._clock()
                log.warning("the broker does not answer: %s; not ready until it does", why)

    def commit_failed(self, why: str) -> None:
        with self._lock:
            if self._commit_failing is None:
                log.warning("committing outputs and offsets fails: %s; not ready until it succeeds", why)
            self._commit_failing = why

    def committed(self) -> None:
        with self._lock:
            if self._commit_failing is not None:
                log.info("committing succeeds again")
            self._commit_failing = None

    def why_not_ready(self) -> str | None:
        with self._lock:
            if not self._assigned:
                return "no partition assignment yet"
            if self._broker_at is None or self._clock() - self._broker_at > self.stale_s:
                return "the broker has not answered recently"
            if self._commit_failing is not None:
                return f"commits fail: {self._commit_failing}"
            return None

    def ready(self) -> bool:
        return self.why_not_ready() is None
