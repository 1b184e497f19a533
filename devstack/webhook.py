"""A webhook receiver that records what Alertmanager sends, for tests."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class WebhookReceiver:
    """Listens on 127.0.0.1; every POSTed JSON body is appended to :attr:`received`, and
    the time it came (seconds since the epoch) to :attr:`received_at`."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.received_at: list[float] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                with receiver._lock:
                    receiver.received.append(body)
                    receiver.received_at.append(time.time())
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/alerts"

    def snapshot(self) -> list[tuple[float, dict[str, Any]]]:
        """What came so far: (when, body) of every POST, in order."""
        with self._lock:
            return list(zip(self.received_at, self.received, strict=True))

    def alert_names(self, status: str = "firing") -> set[str]:
        """Names of alerts received with ``status``."""
        with self._lock:
            return {
                alert["labels"].get("alertname", "")
                for body in self.received
                for alert in body.get("alerts", [])
                if alert.get("status") == status
            }

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
