"""A real ``transformers serve`` process, tapped (``python -m monitor serve``) or not
(``python -m transformers.cli.transformers serve``), on a free port, and completions asked
of it with the ``openai`` client: chat and text completions, streamed or not, with or
without the client's own ``X-Request-ID``."""

from __future__ import annotations

import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devstack.process import ManagedProcess, free_port
from devstack.wait import wait_for

REPO = Path(__file__).resolve().parents[2]
KINDS = ("chat", "chat-stream", "completion", "completion-stream")


@dataclass(frozen=True)
class Answer:
    id: str  #: the id the API returned in its body
    header: str | None  #: its x-request-id response header
    text: str
    tokens: int  #: completion tokens (the usage the server reports)


class Server:
    """The server as a child process (its log in ``log``); ``args``: the model and options."""

    def __init__(self, env: dict[str, str], args: list[str], log: Path, *, tapped: bool = True,
                 name: str = "serve"):
        self.port = free_port()
        command = ["-m", "monitor", "serve"] if tapped else ["-m", "transformers.cli.transformers", "serve"]
        argv = [sys.executable, *command, *args, "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu"]
        self.process = ManagedProcess(name, argv, log, cwd=REPO, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300) -> None:
        def ready() -> bool:
            self.process.check_alive()
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return bool(resp.status == 200)

        wait_for(ready, timeout=timeout, what=f"{self.process.name} serving on :{self.port}", interval=0.25)

    def client(self) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=300)

    def log(self) -> str:
        return self.process.log_path.read_text(errors="replace")

    def stop(self) -> int | None:
        return self.process.stop(timeout=30)


def ask(client: Any, model: str, prompt: str, kind: str, request_id: str | None = None,
        max_tokens: int = 8) -> Answer:
    """One completion of ``kind`` (:data:`KINDS`), greedy."""
    headers = {"X-Request-ID": request_id} if request_id else None
    chat = kind.startswith("chat")
    stream = kind.endswith("-stream")
    common: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream,
                              "extra_headers": headers}
    if stream:
        common["stream_options"] = {"include_usage": True}
    if chat:
        raw = client.chat.completions.with_raw_response.create(messages=[{"role": "user", "content": prompt}],
                                                               **common)
    else:
        raw = client.completions.with_raw_response.create(prompt=prompt, **common)
    header = raw.headers.get("x-request-id")
    parsed = raw.parse()
    if not stream:
        text = parsed.choices[0].message.content if chat else parsed.choices[0].text
        return Answer(parsed.id, header, text or "", parsed.usage.completion_tokens)
    ids, pieces, tokens = set(), [], 0
    for chunk in parsed:
        ids.add(chunk.id)
        for choice in chunk.choices:
            piece = choice.delta.content if chat else choice.text
            if piece:
                pieces.append(piece)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    assert len(ids) == 1, f"a stream's chunks carry one id, got {ids}"
    return Answer(ids.pop(), header, "".join(pieces), tokens)
