"""1,000 idle connections to /metrics: the first release kept a thread for each forever
(1,500 idle sockets, 1,508 threads). An idle connection now closes after
METRICS_IDLE_TIMEOUT_S, and scrapes are served meanwhile."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest

from devstack.wait import wait_for
from tests.service.harness import Monitor, make_topics, monitor_env

pytestmark = [pytest.mark.kafka, pytest.mark.faults]
IDLE = 1000


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no thread count")


def test_a_thousand_idle_metrics_connections_are_dropped_and_scrapes_still_answer(
        kafka_broker, make_topic, unique_name, tmp_path):
    topics = make_topics(make_topic)
    env = monitor_env(kafka_broker.bootstrap, topics, unique_name("group"), tmp_path, metrics_idle_timeout_s=2)
    monitor = Monitor(env, tmp_path / "monitor.log")
    sockets: list[socket.socket] = []
    try:
        monitor.wait_ready()
        before = threads(monitor.process.pid)
        for _ in range(IDLE):
            sockets.append(socket.create_connection(("127.0.0.1", monitor.port), timeout=5))
        wait_for(lambda: threads(monitor.process.pid) >= before + IDLE // 2, timeout=30,
                 what="the idle connections holding threads")
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor.port}/metrics", timeout=10) as resp:
            assert resp.status == 200  # served while a thousand connections sit idle
        wait_for(lambda: threads(monitor.process.pid) <= before + 5, timeout=30,
                 what="the idle connections closed after the idle timeout")
        closed = sum(1 for s in sockets if s.recv(1) == b"")  # the server hung up on each
        assert closed == IDLE
    finally:
        for s in sockets:
            s.close()
        monitor.process.stop()
