"""Where an instance keeps its detector's reference state between runs.

One JSON file per instance (group, client id, host) in the state folder, written whole
to a temporary file and renamed over the old one, so a crash leaves either the old
state or the new one. A file that cannot be read or merged is ignored with a warning:
the service starts without it rather than failing.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from monitor.core.detect import Detector, DetectorConfig
from monitor.errors import MeasuringFailed
from monitor.measuring.workers import Measuring

log = logging.getLogger(__name__)


class StateFile:
    def __init__(self, folder: Path, instance: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"reference-{instance.replace(os.sep, '_')}.json"

    def load(self, config: DetectorConfig) -> dict[str, Any] | None:
        """The saved state, if there is one a detector with ``config`` can merge."""
        if not self.path.exists():
            return None
        try:
            state: dict[str, Any] = json.loads(self.path.read_text())
            Detector(config).merge_state(state)  # refused here, not by the measurer at its start
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable reference state %s: %s", self.path, exc)
            return None
        log.info("reference state loaded from %s", self.path)
        return state

    def save(self, state: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.path)


class StateSaver:
    """When the reference state is written: every ``interval`` seconds (asked of the
    judge and written when it arrives, a later iteration, so the loop never waits), at
    once before committing traces that taught a reference, and last on the way out."""

    def __init__(self, file: StateFile | None, measuring: Measuring, interval: float):
        self.file, self.measuring, self.interval = file, measuring, interval
        self._pending: Future[dict[str, Any]] | None = None
        self._saved_at = time.monotonic()

    def maybe(self) -> None:
        if self.file is None:
            return
        if self._pending is not None and self._pending.done():
            self.file.save(self._pending.result())
            self._pending = None
        if self._pending is None and time.monotonic() - self._saved_at >= self.interval:
            self._saved_at = time.monotonic()
            self._pending = self.measuring.state()

    def now(self) -> None:
        """Save the state now; a periodic save still pending holds an older state and is dropped."""
        if self.file is not None:
            self._pending = None
            self.file.save(self.measuring.state().result())
            self._saved_at = time.monotonic()

    def last(self) -> None:
        if self.file is None:
            return
        try:
            self.file.save(self.measuring.state().result())
        except MeasuringFailed as exc:
            log.error("reference state not saved: %s", exc)
