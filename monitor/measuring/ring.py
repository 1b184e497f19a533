"""A shared ring of record bytes between the service and its measuring process.

The service copies each record value in once and the child reads it in place. (Pickling
values through a pipe made the child fault in fresh pages for every record, which cost
more than decoding it.) The ring is a file in /dev/shm, unlinked as soon as the child has
mapped it, so nothing is left behind whatever way the processes end.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from monitor.errors import MeasuringFailed


class SharedRing:
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
            raise MeasuringFailed(f"cannot reserve {size} bytes for the shared ring in "
                                  f"{folder or tempfile.gettempdir()}: {exc}") from exc
        finally:
            os.close(fd)
        self.size = size
        self._next = 0
        self._held: deque[tuple[int, int, Future[Any]]] = deque()

    def reserve(self, n: int) -> int:
        """A start offset with ``n`` free bytes after it: after the last region handed
        out, at the start, or after any region still held; waits for any chunk in flight
        to finish when none has room (back-pressure from busy children). Regions are freed
        in whatever order their chunks finish, so a child that is ahead is never held back
        by a slower one's older chunk."""
        while True:
            self._held = deque(held for held in self._held if not held[2].done())
            for start in (self._next, 0, *(e for _, e, _ in self._held)):
                end = start + n
                if end <= self.size and all(e <= start or end <= b for b, e, _ in self._held):
                    return start
            wait([future for _, _, future in self._held], return_when=FIRST_COMPLETED)

    def hold(self, start: int, end: int, future: Future[Any]) -> None:
        """Keep ``[start, end)`` until ``future`` is done."""
        self._held.append((start, end, future))
        self._next = end

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        self._held.clear()
        self.buffer.close()


def attach(path: str) -> memoryview:
    """The ring, mapped in the measuring process."""
    with open(path, "r+b") as f:
        return memoryview(mmap.mmap(f.fileno(), 0))
