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
from pathlib import Path
from typing import Any

from monitor.core.detect import Detector, DetectorConfig

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
