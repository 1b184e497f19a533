"""Waiting on a condition with a deadline, instead of sleeping."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class DeadlineExceeded(AssertionError):
    """A condition did not become true before its deadline."""


def wait_for(
    probe: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 0.05,
) -> T:
    """Call ``probe`` until it returns something truthy and return that.

    Exceptions raised by the probe count as "not yet"; the last one is chained to
    :class:`DeadlineExceeded` so a failure says why the condition never held.
    """
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = probe()
        except Exception as exc:
            last_exc = exc
        else:
            if value:
                return value
        if time.monotonic() >= deadline:
            detail = f": last error {last_exc!r}" if last_exc else ""
            raise DeadlineExceeded(f"{what} not true within {timeout:.0f} s{detail}") from last_exc
        time.sleep(interval)
