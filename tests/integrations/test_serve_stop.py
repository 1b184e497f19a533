"""How a real ``attention-monitor serve`` process ends (no model on its command line, so
nothing but the server starts): SIGTERM or SIGINT to its main process alone stops it
cleanly with exit 0, as its help says; a second server on the same address exits 3,
saying why."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.integrations.serve_harness import REPO, Server

pytestmark = pytest.mark.models


@pytest.fixture
def env(tmp_path):
    keyring = tmp_path / "keyring.json"
    keyring.write_text(json.dumps({"team-a": "s" * 32}))
    return {**os.environ, "ATTENTION_MONITOR_KEYRING_FILE": str(keyring),
            "ATTENTION_MONITOR_BOOTSTRAP_SERVERS": "127.0.0.1:1"}


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_main_process_stops_the_server_with_exit_0(env, tmp_path, stop):
    server = Server(env, [], tmp_path / "serve.log")
    try:
        server.wait_ready(timeout=120)
        if stop == signal.SIGTERM:  # meanwhile, a second server on its address
            busy = subprocess.run([sys.executable, "-m", "monitor", "serve", "--host", "127.0.0.1", "--port",
                                   str(server.port), "--device", "cpu"], cwd=REPO, env=env, capture_output=True,
                                  text=True, timeout=120)
            assert busy.returncode == 3, busy.stderr[-3000:]
            assert "error: the server could not start" in busy.stderr and "address already in use" in busy.stderr
        server.process.proc.send_signal(stop)  # the main process only, not its group
        assert server.process.proc.wait(60) == 0, server.log()[-3000:]
    finally:
        server.stop()
