"""A reference state file the service cannot use is ignored with a warning: the
service starts without it rather than failing (its measuring process would otherwise
die merging it)."""

from __future__ import annotations

import json
import logging

import pytest

from monitor.service import Service
from monitor.settings import Settings


@pytest.mark.parametrize("content", ["{not json", json.dumps({"references": [{"key": 1}]}),
                                     json.dumps({"references": [{"key": ["m", "r", 0, 0], "reference": {}}]})])
def test_an_unusable_state_file_is_ignored(tmp_path, caplog, content):
    service = Service(Settings(metrics_port=0, state_dir=tmp_path))
    assert service._state_path is not None
    service._state_path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="monitor.service"):
        assert service._load_state() is None
    assert "ignoring unreadable reference state" in caplog.text


def test_a_usable_state_file_is_loaded(tmp_path):
    service = Service(Settings(metrics_port=0, state_dir=tmp_path))
    assert service._state_path is not None
    service._state_path.write_text(json.dumps({"references": []}))
    assert service._load_state() == {"references": []}
