"""The model's process of ``attention-monitor serve``: a request that reaches the model
with an id that cannot be a trace's (an invalid ``X-Request-ID``) or with none is served
untraced, counted once under its reason, and said once, in one warning that says which
header and which rule; the tap does not count it again as a forward pass outside a
request."""

from __future__ import annotations

import logging

import pytest
import torch

from monitor.integrations.serving import Publisher, ServedModel, ServeTap
from monitor.integrations.serving_ids import REQUEST_ID_KEY
from monitor.integrations.transformers import attach
from monitor.protocol.schema import Scope
from monitor.protocol.topics import DEFAULT
from tests.integrations.models import sharpened

pytestmark = pytest.mark.models
SCOPE = Scope(tenant="team-a", data_class="internal")


def served(sink: list) -> ServedModel:
    model, _ = sharpened("llama")
    tap = attach(model, lambda *trace: sink.append(trace), sample_rate=1.0, rows=2, decode_rows=1, scope=SCOPE)
    settings = ServeTap(Publisher({}, DEFAULT, "k", b"s" * 16), SCOPE, sample_rate=1.0)
    return ServedModel(model, tap, producer=None, settings=settings)  # type: ignore[arg-type]  # never sends


def test_an_invalid_or_missing_id_is_served_untraced_counted_once_by_reason_and_said_once(caplog):
    sink: list = []
    model = served(sink)
    prompt = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(1))
    options = {"max_new_tokens": 3, "do_sample": False}
    with caplog.at_level(logging.WARNING):
        for rid in ("bad id!", "-leading-dash"):
            model.generate(prompt, **options, **{REQUEST_ID_KEY: rid})
        model.generate(prompt, **options)
        model.generate(prompt, **options, **{REQUEST_ID_KEY: "chatcmpl-1"})
    assert model.tap.flush(timeout=30)
    assert (model.counts.requests, model.counts.sampled) == (4, 1)
    assert model.counts.untraced == {"no_request_id": 1, "invalid_request_id": 2}
    assert not model.tap.counts.untraced  # not also counted as forward passes outside a request
    assert {trace[0].request_id for trace in sink} == {"chatcmpl-1"}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # one a reason
    invalid = next(w for w in warnings if "invalid_request_id" in w)
    assert "X-Request-ID header 'bad id!'" in invalid and "starting with a letter or digit" in invalid
    assert not any("tap.carry" in w or "lost on the way" in w for w in warnings)
    assert "untraced_invalid_request_id=2" in model.line()


def test_the_counts_line_says_which_untraced_counts_are_forward_passes():
    from monitor.integrations.sender import TapCounts

    line = TapCounts(1, 1, 0, 0, 0, untraced={"outside_request": 6, "request_id": 2}).line()
    assert "untraced_passes[outside_request]=6" in line and "untraced[request_id]=2" in line
