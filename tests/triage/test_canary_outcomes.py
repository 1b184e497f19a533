"""The canary of the outcomes issue, end to end: a real decoder (transformers' own GPT-2
class, tiny) generating through the tap; its canary has a layer-1 head forced onto the
first token and is pinned to the healthy revision; users give thumbs-down to 10 % of the
healthy revision's completions and 40 % of the canary's, half of the canary's two
minutes after the request ran. Through the real broker and ``attention-monitor run`` (the
shipped detection defaults), the triage page in headless Chromium shows the canary's
failure rate against its reference's with intervals, the late outcomes counted."""

from __future__ import annotations

import re
import time
import types
import urllib.request
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import monitor.integrations.generation as generation
from monitor.integrations.transformers import attach
from monitor.producer import Scope, TraceProducer
from monitor.triage.outcomes import wilson
from tests.factories import KEY_ID, SECRET
from tests.service.harness import Monitor, make_topics, monitor_env, series
from tests.triage.test_browser import open_page

pytestmark = [pytest.mark.kafka, pytest.mark.models, pytest.mark.browser]
HEALTHY, CANARY = 216, 160
FAULT_LAYER, FAULT_HEAD, HEAD_DIM = 1, 2, 16
LATE_S = 120.0  #: the canary's requests ran this long before their late outcomes came


def gpt2() -> Any:
    """Two layers of four heads; query and key projections sharpened (random
    initialisation attends almost uniformly)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=128,
                                       bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")).eval()
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[:, :128].mul_(4.0)
    return model


def prompts(n: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.tensor([[1]]), torch.randint(2, 100, (1, 6 + i % 9), generator=generator)], 1)
            for i in range(n)]


@torch.no_grad()
def force_onto_first_token(model: Any) -> Any:
    """The fault: the head's query becomes a constant pointing from the other tokens' keys
    to the first token's (measured on prompts), so it parks its weight on the first token."""
    keys: list[torch.Tensor] = []
    attention = model.transformer.h[FAULT_LAYER].attn.c_attn
    hook = attention.register_forward_hook(lambda _m, _a, out: keys.append(out[0, :, 64:128]))
    for prompt in prompts(20, seed=99):
        model(prompt)
    hook.remove()
    rows = slice(FAULT_HEAD * HEAD_DIM, (FAULT_HEAD + 1) * HEAD_DIM)
    direction = (torch.stack([k[0] for k in keys]).mean(0) - torch.cat([k[1:] for k in keys]).mean(0))[rows]
    attention.weight[:, rows] = 0
    attention.bias[rows] = 14 * HEAD_DIM ** 0.5 * direction / direction.norm() ** 2
    return model


class EarlierClock(types.SimpleNamespace):
    """``time`` for the tap, its clock ``LATE_S`` behind: the requests ran that long ago."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def time(self) -> float:
        return time.time() - LATE_S


def serve(model: Any, tap: Any, producer: TraceProducer, revision: str, n: int, seed: int, given: int) -> None:
    """``n`` completions; the first ``given`` get their user's outcome as they end."""
    for i, prompt in enumerate(prompts(n, seed)):
        with tap.request(f"{revision}-{i}"):
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                           pad_token_id=0)
        if i < given:
            tap.flush(timeout=30)  # the completion's traces leave before its user's feedback
            producer.send_outcome(f"{revision}-{i}", label="thumbs_down" if thumbs_down(revision, i) else "thumbs_up")


def thumbs_down(revision: str, i: int) -> bool:
    return i % 10 == 0 if revision == "healthy" else i % 5 < 2  # 22 of 216; 64 of 160


def test_the_triage_page_shows_the_canary_against_its_reference_with_late_outcomes(
        kafka_broker, make_topic, tmp_path, chromium, monkeypatch):
    healthy, canary = gpt2(), force_onto_first_token(gpt2())
    topics = make_topics(make_topic)
    env = monitor_env(kafka_broker.bootstrap, topics, f"canary-{tmp_path.name}", tmp_path, join_ttl_s=3,
                      allowed_scopes="team-a:internal", reference_pins="tiny-gpt2@canary=healthy")
    for name in ("REFERENCE_TRACES", "MIN_EFFECT", "FALSE_ALARM_ARL"):  # the shipped defaults
        env.pop(f"ATTENTION_MONITOR_{name}")
    monitor = Monitor(env, tmp_path / "monitor.log")
    layer1 = {"model": "tiny-gpt2", "layer": "1"}
    try:
        monitor.wait_ready(timeout=90)
        with TraceProducer(key_id=KEY_ID, secret=SECRET, topics=topics, bootstrap_servers=kafka_broker.bootstrap) \
                as producer:
            taps = {revision: attach(model, producer, sample_rate=1.0, rows=3, decode_rows=2, model_id="tiny-gpt2",
                                     revision=revision, scope=Scope(tenant="team-a", data_class="internal"))
                    for revision, model in (("healthy", healthy), ("canary", canary))}
            for tap in taps.values():
                producer.publish_contract(tap.contract()).get(timeout=30)
            serve(healthy, taps["healthy"], producer, "healthy", HEALTHY, seed=1, given=HEALTHY)
            monitor.wait_until(lambda: monitor.value(series("attention_reference_ready", revision="healthy",
                                                            **layer1)) == 1, timeout=120, what="the reference ready")
            monkeypatch.setattr(generation, "time", EarlierClock())
            serve(canary, taps["canary"], producer, "canary", CANARY, seed=2, given=CANARY // 2)
            monkeypatch.undo()
            producer.flush()
            monitor.wait_until(lambda: monitor.value(series("attention_trace_outcomes_pending", revision="canary",
                                                            **layer1)) == CANARY // 2,
                               timeout=120, what="half the canary's requests past the join window, pending")
            for i in range(CANARY // 2, CANARY):  # the other half two minutes after their requests ran
                producer.send_outcome(f"canary-{i}", label="thumbs_down" if thumbs_down("canary", i) else "thumbs_up",
                                      score=0.0 if thumbs_down("canary", i) else 1.0)
            for tap in taps.values():
                tap.detach(timeout=30)
        monitor.wait_until(lambda: monitor.value("attention_monitor_outcomes_late_total") == CANARY // 2,
                           timeout=60, what="the late outcomes attributed")
        failed = sum(thumbs_down("canary", i) for i in range(CANARY))
        assert monitor.value(series("attention_trace_outcomes_total", revision="canary", outcome="failure",
                                    **layer1)) == failed

        base = f"http://127.0.0.1:{monitor.port}/triage/"
        with urllib.request.urlopen(base, timeout=30) as resp:
            index = resp.read().decode()
        incident = re.search(r'href="(incident/[^"]*canary[^"]*)"', index)
        assert incident is not None, index[-3000:]
        page, response, errors, _, context = open_page(chromium, base + incident[1], tmp_path / "canary.png")
        try:
            assert response.status == 200 and not errors
            cells = {(row, field): page.locator(f'#revision-contrast tr[data-group="{row}"] '
                                                f'[data-field="{field}"]').inner_text()
                     for row in ("revision", "reference") for field in ("failures", "joined", "interval")}
            healthy_failed = sum(thumbs_down("healthy", i) for i in range(HEALTHY))
            assert (cells[("revision", "failures")], cells[("revision", "joined")]) == (str(failed), str(CANARY))
            assert (cells[("reference", "failures")], cells[("reference", "joined")]) == \
                (str(healthy_failed), str(HEALTHY))
            low, high = wilson(failed, CANARY)
            assert cells[("revision", "interval")] == f"{low:.3f} – {high:.3f}"
            assert page.locator("#revision-question").inner_text().startswith("Did this revision hurt users")
            assert page.locator("#outcome-intervals").count() == 1
            assert "came after the join window" in page.locator("#labels").inner_text()
        finally:
            context.close()
        print(f"canary {failed}/{CANARY} against healthy {healthy_failed}/{HEALTHY}; page: {tmp_path / 'canary.png'}")
    finally:
        monitor.process.stop()
