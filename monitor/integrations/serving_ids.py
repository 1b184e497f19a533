"""Request ids a client knows, for a served LLM: the ASGI middleware that gives each
completion the id its traces go by and hands that id to the generation.

A client of an OpenAI-style API knows the id the API returned (the response's ``id``) or
the ``X-Request-ID`` it sent itself; it can send an outcome later only by one of those.
:class:`RequestIds` runs outermost in the server's ASGI app, on ``POST`` to
``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses``:

- a request that carries ``X-Request-ID`` keeps it; one that does not is given one in the
  API's own style (``chatcmpl-…``, ``cmpl-…``, or a bare id that ``/v1/responses`` returns
  as ``resp_…``), set as its ``X-Request-ID`` header, which transformers' server adopts as
  the response's id and ``x-request-id`` header;
- the request's *trace id* is the client's ``X-Request-ID`` when it sent one, else the id
  the API returns (:func:`trace_request_id`);
- the trace id is added to the request's ``generation_config`` (the JSON of generation
  settings transformers' server takes from a request and hands to the generation, in the
  model's process) under :data:`REQUEST_ID_KEY`; the model's process takes it out again
  before ``generate`` sees it (:mod:`monitor.integrations.serving`).

Whatever the middleware cannot read (a body that is not a JSON object, a
``generation_config`` that is not a JSON object) is passed on unchanged and served
untraced, counted by reason in :class:`IdCounts` and said once in the log: never refused
here. An ``X-Request-ID`` that cannot be a trace's request id is handed on like a valid
one: the model's process serves that request untraced and counts it with its other
counts (``untraced_invalid_request_id``), where it is seen, and says why once.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from monitor.protocol.schema import check_identifier

log = logging.getLogger(__name__)

#: the generation setting that carries a request's trace id to the model's process
REQUEST_ID_KEY = "attention_monitor_request_id"
#: endpoints whose requests generate, and the prefix of an id given to one that brought none
GENERATING = {"/v1/chat/completions": "chatcmpl-", "/v1/completions": "cmpl-", "/v1/responses": ""}
#: what an endpoint's returned id adds in front of the request's X-Request-ID
RETURNED_PREFIX = {"/v1/responses": "resp_"}
#: why a generating request goes untraced (the counters' closed set of reasons)
UNTRACED_REASONS = ("invalid_request_id", "unreadable_body")
X_REQUEST_ID = b"x-request-id"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def trace_request_id(path: str, given: str | None, assigned: str) -> str:
    """The id a completion's traces go by: the ``X-Request-ID`` the client sent
    (``given``), else the id the API returns for ``assigned``, the request's
    ``X-Request-ID``: the same for chat and completions, ``resp_`` + it for responses."""
    return given if given is not None else RETURNED_PREFIX.get(path, "") + assigned


def with_request_id(body: bytes, request_id: str) -> bytes | None:
    """The JSON request ``body`` with ``request_id`` added to its ``generation_config``
    (created when absent, a client's own settings kept); None when the body is not a JSON
    object or its ``generation_config`` is not a JSON object in a string."""
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(request, dict):
        return None
    settings: Any = {}
    if request.get("generation_config") is not None:
        if not isinstance(request["generation_config"], str):
            return None
        try:
            settings = json.loads(request["generation_config"])
        except json.JSONDecodeError:
            return None
        if not isinstance(settings, dict):
            return None
    settings[REQUEST_ID_KEY] = request_id
    request["generation_config"] = json.dumps(settings)
    return json.dumps(request, ensure_ascii=False).encode()


class IdCounts:
    """Generating requests seen by one API process: traced (a trace id handed to the
    generation) or untraced by reason; each reason said once in the log."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.untraced = dict.fromkeys(UNTRACED_REASONS, 0)

    def seen(self) -> None:
        with self._lock:
            self.requests += 1

    def refuse(self, reason: str, detail: str | None) -> None:
        """Count a request served untraced for ``reason``; say it once with ``detail``
        (None: the model's process says it, as an invalid id reaches it)."""
        with self._lock:
            first = not self.untraced[reason]
            self.untraced[reason] += 1
        if first and detail is not None:
            log.warning("attention tap: a request is served untraced (%s: %s); later ones are counted, not logged",
                        reason, detail)


class RequestIds:
    """The ASGI middleware (see the module documentation). ``app``: the server's app."""

    def __init__(self, app: App, counts: IdCounts | None = None):
        self.app = app
        self.counts = counts or IdCounts()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope.get("type") != "http" or scope.get("method") != "POST" or path not in GENERATING:
            await self.app(scope, receive, send)
            return
        self.counts.seen()
        headers = list(scope.get("headers", ()))
        sent = next((value for name, value in headers if name.lower() == X_REQUEST_ID), None)
        given = sent.decode("latin-1") if sent is not None else None
        assigned = given if given is not None else f"{GENERATING[path]}{uuid.uuid4().hex}"
        if given is None:
            headers.append((X_REQUEST_ID, assigned.encode()))
        scope = {**scope, "headers": headers}
        request_id = trace_request_id(path, given, assigned)
        body, tail = await _read_body(receive)
        changed = with_request_id(body, request_id) if tail is None else None
        if changed is None:
            if tail is None:
                self.counts.refuse("unreadable_body", f"{path}: not a JSON object with a JSON generation_config")
            await self.app(scope, _replay(body, tail, receive), send)
            return
        try:
            check_identifier(request_id, "X-Request-ID")
        except ValueError:
            # handed on as it is: the model's process serves it untraced, counts it under
            # untraced_invalid_request_id with the model's other counts, and says why once
            self.counts.refuse("invalid_request_id", None)
        scope["headers"] = [(name, value) for name, value in headers if name.lower() != b"content-length"]
        scope["headers"].append((b"content-length", str(len(changed)).encode()))
        await self.app(scope, _replay(changed, None, receive), send)


async def _read_body(receive: Receive) -> tuple[bytes, Message | None]:
    """The request's whole body, and the first message that was not part of it (a
    disconnect), if one came instead of its end."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message.get("type") != "http.request":
            return b"".join(chunks), message
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), None


def _replay(body: bytes, tail: Message | None, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` in one message (then ``tail``, if the client
    left early), and then whatever the server's own ``receive`` gives (its disconnect)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
    if tail is not None:
        pending.append(tail)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
