"""The request-id middleware of ``attention-monitor serve``, driven through the ASGI
protocol as uvicorn drives it: which id a completion is traced under, how it reaches the
generation's settings, and that whatever it cannot read passes unchanged and is counted."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from monitor.integrations.serving_ids import REQUEST_ID_KEY, IdCounts, RequestIds, with_request_id

pytestmark = pytest.mark.models  # collected with the other integrations (needs the transformers extra's env)


class Downstream:
    """The server's app: records the scope and the body it was given."""

    def __init__(self):
        self.scope = None
        self.body = b""
        self.after = None

    async def __call__(self, scope, receive, send):
        self.scope = scope
        while True:
            message = await receive()
            self.body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.after = await receive()  # what comes next: the client's disconnect
        await send({"type": "http.response.start", "status": 200, "headers": []})


def call(path, body, headers=(), method="POST", chunks=1):
    """Run the middleware on one request; the downstream app and the counts."""
    downstream, counts = Downstream(), IdCounts()
    size = max(1, -(-len(body) // chunks))
    parts = [body[i: i + size] for i in range(0, len(body), size)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    messages.append({"type": "http.disconnect"})

    async def receive():
        return messages.pop(0)

    async def send(message):
        pass

    scope = {"type": "http", "method": method, "path": path,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *headers]}
    asyncio.run(RequestIds(downstream, counts)(scope, receive, send))
    return downstream, counts


def header(scope, name):
    return next((v.decode() for k, v in scope["headers"] if k == name.encode()), None)


def settings(body):
    return json.loads(json.loads(body)["generation_config"])


CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "héllo"}], "max_tokens": 4}).encode()


@pytest.mark.parametrize(("path", "pattern", "returned"), [
    ("/v1/chat/completions", r"chatcmpl-[0-9a-f]{32}", ""),
    ("/v1/completions", r"cmpl-[0-9a-f]{32}", ""),
    ("/v1/responses", r"[0-9a-f]{32}", "resp_"),
])
def test_a_request_without_an_id_gets_one_in_the_apis_style_and_is_traced_under_the_id_returned(path, pattern,
                                                                                                 returned):
    downstream, counts = call(path, CHAT)
    given = header(downstream.scope, "x-request-id")
    assert re.fullmatch(pattern, given)
    assert settings(downstream.body) == {REQUEST_ID_KEY: returned + given}
    request = json.loads(downstream.body)
    assert request["messages"][0]["content"] == "héllo" and request["max_tokens"] == 4
    assert header(downstream.scope, "content-length") == str(len(downstream.body))
    assert [k for k, _ in downstream.scope["headers"]].count(b"content-length") == 1
    assert downstream.after == {"type": "http.disconnect"}
    assert (counts.requests, sum(counts.untraced.values())) == (1, 0)


def test_a_clients_x_request_id_is_kept_and_traced_as_sent_even_on_responses_and_its_settings_are_kept():
    body = json.dumps({"input": "hi", "generation_config": json.dumps({"top_k": 3, REQUEST_ID_KEY: "spoofed"})})
    downstream, _ = call("/v1/responses", body.encode(), headers=[(b"x-request-id", b"team-a/req:42")], chunks=3)
    assert [v for k, v in downstream.scope["headers"] if k == b"x-request-id"] == [b"team-a/req:42"]
    assert settings(downstream.body) == {"top_k": 3, REQUEST_ID_KEY: "team-a/req:42"}


@pytest.mark.parametrize("invalid", [b"bad id!", b"-leading-dash", b"x" * 129])
def test_an_invalid_x_request_id_is_handed_to_the_model_process_which_counts_it(invalid, caplog):
    downstream, counts = call("/v1/chat/completions", CHAT, headers=[(b"x-request-id", invalid)])
    assert settings(downstream.body) == {REQUEST_ID_KEY: invalid.decode()}
    assert counts.untraced["invalid_request_id"] == 1 and counts.requests == 1
    assert "attention tap" not in caplog.text  # the model's process says it, once


@pytest.mark.parametrize(("body", "headers", "reason"), [
    (b"not json", [], "unreadable_body"),
    (b"[1, 2]", [], "unreadable_body"),
    (json.dumps({"messages": [], "generation_config": "{not json"}).encode(), [], "unreadable_body"),
    (json.dumps({"messages": [], "generation_config": "[1]"}).encode(), [], "unreadable_body"),
    (json.dumps({"messages": [], "generation_config": {"top_k": 1}}).encode(), [], "unreadable_body"),
])
def test_what_cannot_carry_a_trace_id_passes_unchanged_and_is_counted(body, headers, reason):
    downstream, counts = call("/v1/chat/completions", body, headers=headers, chunks=2)
    assert downstream.body == body
    assert counts.untraced[reason] == 1 and counts.requests == 1
    assert header(downstream.scope, "content-length") == str(len(body))


@pytest.mark.parametrize(("method", "path"), [("GET", "/health"), ("POST", "/load_model"), ("GET", "/v1/models"),
                                              ("GET", "/v1/chat/completions")])
def test_requests_that_do_not_generate_pass_untouched(method, path):
    downstream, counts = call(path, CHAT, method=method)
    assert downstream.body == CHAT and header(downstream.scope, "x-request-id") is None
    assert counts.requests == 0


def test_the_body_keeps_every_value_the_server_would_parse():
    original = {"prompt": "x", "temperature": 0.1, "seed": 2**70, "stop": ["\n"], "logit_bias": {"5": -1.5},
                "nested": {"a": [None, True, 1e-300]}}
    changed = json.loads(with_request_id(json.dumps(original).encode(), "r-1"))
    assert {k: v for k, v in changed.items() if k != "generation_config"} == original
