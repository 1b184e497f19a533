"""A reference state file the service cannot use is ignored with a warning: the service
starts without it rather than failing (its measuring process would otherwise die merging
it)."""

from __future__ import annotations

import json
import logging

import pytest

from monitor.core.detect import DetectorConfig
from monitor.service.state_file import StateFile


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 3, "references": [{"key": 1}]}),
                                     json.dumps({"version": 3, "references": [{"key": ["m", "r", 0],
                                                                               "reference": {}}]}),
                                     json.dumps({"references": []})])  # the first release's format
def test_an_unusable_state_file_is_ignored(tmp_path, caplog, content):
    state = StateFile(tmp_path, "instance")
    state.path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="monitor.service.state_file"):
        assert state.load(DetectorConfig()) is None
    assert "ignoring unreadable reference state" in caplog.text


def test_a_saved_state_is_loaded_back(tmp_path):
    state = StateFile(tmp_path, "instance")
    assert state.load(DetectorConfig()) is None  # nothing saved yet
    state.save({"version": 3, "references": [], "decisions": []})
    assert state.load(DetectorConfig()) == {"version": 3, "references": [], "decisions": []}
    assert not state.path.with_suffix(".tmp").exists()
