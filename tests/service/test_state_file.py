"""A reference state file the service cannot use is ignored with a warning: the service
starts without it rather than failing (its measuring process would otherwise die merging
it)."""

from __future__ import annotations

import json
import logging

import pytest

from monitor.core.detect import DetectorConfig
from monitor.state_file import StateFile


@pytest.mark.parametrize("content", ["{not json", json.dumps({"references": [{"key": 1}]}),
                                     json.dumps({"references": [{"key": ["m", "r", 0, 0], "reference": {}}]})])
def test_an_unusable_state_file_is_ignored(tmp_path, caplog, content):
    state = StateFile(tmp_path, "instance")
    state.path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="monitor.state_file"):
        assert state.load(DetectorConfig()) is None
    assert "ignoring unreadable reference state" in caplog.text


def test_a_saved_state_is_loaded_back(tmp_path):
    state = StateFile(tmp_path, "instance")
    assert state.load(DetectorConfig()) is None  # nothing saved yet
    state.save({"references": []})
    assert state.load(DetectorConfig()) == {"references": []}
    assert not state.path.with_suffix(".tmp").exists()
