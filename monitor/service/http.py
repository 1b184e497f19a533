"""The monitor's HTTP endpoint: ``/metrics`` and ``/triage/…`` (optionally TLS and basic
auth, the same for both), ``/healthz`` (the process runs) and ``/readyz`` (it consumes
and can commit)."""

from __future__ import annotations

import base64
import hmac
import logging
import ssl
import sys
import threading
from collections.abc import Callable, Iterable
from http import HTTPStatus
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger(__name__)
StartResponse = Callable[..., Any]
#: renders a triage page from its path below ``/triage/`` and its query string: its HTTP
#: status (404 for an unknown page, 400 for a malformed request) and its HTML
Pages = Callable[[str, str], tuple[int, str]]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True
    #: connections the kernel queues before accept; socketserver's default of 5 made
    #: a burst of 300 connections take 47 s to be accepted.
    request_queue_size = 1024

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went quiet (idle timeout) or away is routine, not a traceback.
        if isinstance(sys.exc_info()[1], (TimeoutError, ConnectionError, ssl.SSLError)):
            return
        super().handle_error(request, client_address)


class _QuietHandler(WSGIRequestHandler):
    timeout = 10.0  #: seconds an idle connection may hold its thread (set per server)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class MetricsServer:
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        address: str = "127.0.0.1",
        port: int = 9464,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        basic_auth: tuple[str, str] | None = None,
        ready: Callable[[], bool] = lambda: True,
        idle_timeout_s: float = 10.0,
        pages: Pages | None = None,
    ):
        self._metrics = make_wsgi_app(registry)
        self._ready = ready
        self._pages = pages
        self._auth = None
        if basic_auth is not None:
            token = base64.b64encode(f"{basic_auth[0]}:{basic_auth[1]}".encode()).decode()
            self._auth = f"Basic {token}".encode()
        handler = type("_Handler", (_QuietHandler,), {"timeout": idle_timeout_s})
        self._server = make_server(address, port, self._app, server_class=_Server, handler_class=handler)
        self.tls = tls_cert is not None
        if tls_cert is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(tls_cert), str(tls_key) if tls_key else None)
            # The handshake runs on first read, in the request's thread, so a silent
            # client cannot hold up the accepting thread.
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True,
                                                      do_handshake_on_connect=False)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = self._server.server_address[0]
        if isinstance(host, bytes):
            host = host.decode()
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/healthz":
            return _text(start_response, "200 OK", "ok\n")
        if path == "/readyz":
            if self._ready():
                return _text(start_response, "200 OK", "ready\n")
            return _text(start_response, "503 Service Unavailable", "not ready\n")
        triage = self._pages is not None and (path == "/triage" or path.startswith("/triage/"))
        if path not in ("/metrics", "/") and not triage:
            return _text(start_response, "404 Not Found", "not found\n")
        if self._auth is not None:
            given = environ.get("HTTP_AUTHORIZATION", "").encode()
            if not hmac.compare_digest(given, self._auth):
                start_response("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="attention-monitor"'),
                                                    ("Content-Type", "text/plain")])
                return [b"unauthorized\n"]
        if triage:
            return self._triage(path, environ.get("QUERY_STRING", ""), start_response)
        environ["PATH_INFO"] = "/metrics"
        result: Iterable[bytes] = self._metrics(environ, start_response)
        return result


    def _triage(self, path: str, query: str, start_response: StartResponse) -> list[bytes]:
        assert self._pages is not None
        if path == "/triage":  # relative links on the pages need the trailing slash
            start_response("301 Moved Permanently", [("Location", "/triage/"), ("Content-Type", "text/plain")])
            return [b"/triage/\n"]
        try:
            status, html = self._pages(path.removeprefix("/triage/"), query)
        except Exception as exc:  # the broker away, a record we cannot draw: say so, keep serving
            log.warning("triage page %s failed: %s", path, exc)
            return _text(start_response, "503 Service Unavailable", f"triage page unavailable: {exc}\n")
        start_response(f"{status} {HTTPStatus(status).phrase}",
                       [("Content-Type", "text/html; charset=utf-8"),
                        ("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; img-src data:")])
        return [html.encode()]


def _text(start_response: StartResponse, status: str, body: str) -> list[bytes]:
    start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
    return [body.encode()]
