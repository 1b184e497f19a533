"""Hands captured traces to a sink from a background thread, so publishing never blocks
the forward pass: a bounded queue (a full queue drops the trace and counts it), one
sender thread, and counters for every trace's fate."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TapCounts:
    """What happened to the traces of sampled requests."""

    sampled: int  #: traces captured from sampled requests (one per sequence × layer)
    published: int  #: handed to the sink
    dropped: int  #: refused because the queue was full (the forward pass never waits)
    failed: int  #: the sink raised, or capturing raised (the forward pass is never affected)
    queued: int  #: waiting to be handed to the sink now
    #: what the tap served untraced, by reason (see ``AttentionTap.counts``): requests, or
    #: forward passes for the reasons about passes
    untraced: Mapping[str, int] = field(default_factory=dict)
    #: the reasons counted in forward passes rather than requests (``untraced_passes[...]`` in the line)
    PER_PASS = frozenset({"outside_request"})

    def line(self) -> str:
        untraced = "".join(f" untraced{'_passes' if reason in self.PER_PASS else ''}[{reason}]={n}"
                           for reason, n in sorted(self.untraced.items()))
        return (f"sampled={self.sampled} published={self.published} dropped={self.dropped} failed={self.failed} "
                f"queued={self.queued}{untraced}")


class Sender:
    """``offer`` from any thread (never blocks); on the sender thread, ``expand(item)``
    turns an offered item into traces and ``send(trace)`` hands each to the sink. An item
    may carry several traces (a batch's sequences at one layer), so the forward pass
    queues once per layer; capacity and counts are in traces."""

    def __init__(self, send: Callable[[Any], None], capacity: int,
                 expand: Callable[[Any], list[Any]] = lambda item: [item]):
        if capacity < 1:
            raise ValueError("the queue needs room for at least one trace")
        self._send = send
        self._expand = expand
        self._capacity = capacity
        self._items: deque[tuple[Any, int]] = deque()
        self._waiting = 0  #: traces in the queue
        self._busy = 0  #: traces taken by the sender and not finished yet
        self._changed = threading.Condition()
        self._closed = False
        self._sampled = self._published = self._dropped = self._failed = 0
        self._untraced: Counter[str] = Counter()
        self._thread = threading.Thread(target=self._run, name="attention-tap-sender", daemon=True)
        self._thread.start()

    def offer(self, item: Any, traces: int = 1) -> bool:
        """Queue ``item`` of ``traces`` traces; False (and all counted as dropped) when the
        queue has no room for them or is closed."""
        with self._changed:
            self._sampled += traces
            if self._closed or self._waiting + traces > max(self._capacity, traces):
                self._dropped += traces
                return False
            self._items.append((item, traces))
            self._waiting += traces
            self._changed.notify_all()
            return True

    def failed(self, traces: int = 1) -> None:
        """Count traces that could not be captured."""
        with self._changed:
            self._sampled += traces
            self._failed += traces

    def untraced(self, reason: str, count: int = 1) -> bool:
        """Count something served untraced for ``reason``; True the first time the reason is seen."""
        with self._changed:
            first = reason not in self._untraced
            self._untraced[reason] += count
            return first

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued was handed to the sink; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while self._items or self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._changed.wait(remaining)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Flush, then stop the sender thread; False if the queue did not drain in time."""
        drained = self.flush(timeout)
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join(timeout)
        return drained

    def counts(self) -> TapCounts:
        with self._changed:
            return TapCounts(self._sampled, self._published, self._dropped, self._failed, self._waiting + self._busy,
                             dict(self._untraced))

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._items and not self._closed:
                    self._changed.wait()
                if not self._items:
                    return
                item, traces = self._items.popleft()
                self._waiting -= traces
                self._busy += traces
            try:
                expanded = self._expand(item)
            except Exception as exc:
                log.warning("building traces failed: %s: %s", type(exc).__name__, exc)
                expanded = []
            published = 0
            for trace in expanded:
                try:
                    self._send(trace)
                    published += 1
                except Exception as exc:  # a sink failure costs this trace, never the model
                    log.warning("the trace sink failed: %s: %s", type(exc).__name__, exc)
            with self._changed:
                self._busy -= traces
                self._published += published
                self._failed += traces - published
                self._changed.notify_all()
