"""The one backoff of the service's loops: a broker call tried again while its error is
retriable, waiting twice as long each time up to a ceiling.

Three loops use it: polling (a few tries, then the error ends the service), reading a
table the service cannot run without (until it succeeds or a stop is asked for) and
committing a batch (:mod:`monitor.service.delivery`, until it succeeds, or a stop's grace
runs out).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from monitor.errors import InfrastructureError

__all__ = ["Backoff", "retry"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class Backoff:
    """Waits that double from ``first`` seconds up to ``ceiling``."""

    def __init__(self, first: float = 0.5, ceiling: float = 10.0):
        self.delay, self.ceiling = first, ceiling

    def wait(self) -> None:
        time.sleep(self.delay)
        self.delay = min(2 * self.delay, self.ceiling)


def retry(action: Callable[[], T], what: str, attempts: int = 5, first: float = 0.2) -> T:
    """``action``, tried up to ``attempts`` times while it raises a retriable
    :class:`InfrastructureError`; the last error is raised."""
    backoff = Backoff(first, ceiling=first * 2 ** attempts)
    for attempt in range(attempts):
        try:
            return action()
        except InfrastructureError as exc:
            if not exc.retriable or attempt == attempts - 1:
                raise
            log.warning("%s failed (%s); retrying in %.1f s", what, exc, backoff.delay)
            backoff.wait()
    raise AssertionError("unreachable")
