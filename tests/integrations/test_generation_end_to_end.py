"""A gpt-oss-style model (transformers' own class: learned sinks, a sliding layer and a full
one) generating through the tap, signed traces through the real broker into
``attention-monitor run``: every trace accepted, prompt and decoding rows together, and
the generation metrics (prompt mass, learned sink mass) on /metrics."""

from __future__ import annotations

import pytest
import torch

from monitor.integrations.transformers import attach
from monitor.producer import Scope, TraceProducer
from tests.factories import KEY_ID, SECRET
from tests.integrations.models import sharpened
from tests.service.harness import Monitor, make_topics, monitor_env, series

pytestmark = [pytest.mark.kafka, pytest.mark.models]
REQUESTS = 6


def test_a_gpt_oss_style_model_generates_through_the_tap_and_the_monitor_measures_its_decoding(
        kafka_broker, make_topic, tmp_path):
    model, _ = sharpened("gpt_oss")
    topics = make_topics(make_topic)
    env = monitor_env(kafka_broker.bootstrap, topics, f"gen-{tmp_path.name}", tmp_path,
                      allowed_scopes="team-a:internal")
    monitor = Monitor(env, tmp_path / "monitor.log")
    try:
        monitor.wait_ready()
        with TraceProducer(key_id=KEY_ID, secret=SECRET, topics=topics, bootstrap_servers=kafka_broker.bootstrap) \
                as producer:
            tap = attach(model, producer, sample_rate=1.0, rows=3, decode_rows=3, model_id="tiny-gpt-oss",
                         scope=Scope(tenant="team-a", data_class="internal"))
            contract = tap.contract()
            assert [bool(layer.learned_sink) for layer in contract.layers] == [True, True]
            assert [layer.window for layer in contract.layers] == [6, None]
            producer.publish_contract(contract).get(timeout=30)
            generator = torch.Generator().manual_seed(11)
            for i in range(REQUESTS):
                prompt = torch.randint(3, 100, (1, 5 + i), generator=generator)
                with tap.request(f"gen-{i}"), torch.no_grad():
                    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                                   do_sample=False, pad_token_id=0)
            counts = tap.detach(timeout=30)
        assert (counts.published, counts.failed, counts.dropped) == (2 * REQUESTS, 0, 0)
        labels = {"model": "tiny-gpt-oss", "revision": contract.model_revision}
        for layer in ("0", "1"):
            monitor.wait_until(lambda layer=layer: monitor.value(series("attention_traces_total", layer=layer,
                                                                        **labels)) == REQUESTS,
                               timeout=60, what=f"layer {layer} measured")
            for metric in ("attention_layer_prompt_mass_count", "attention_layer_learned_sink_mass_count"):
                assert monitor.value(series(metric, layer=layer, **labels)) == REQUESTS, metric
            mean = (monitor.value(series("attention_layer_prompt_mass_sum", layer=layer, **labels)) / REQUESTS)
            assert 0.0 < mean < 1.0  # decoding rows look back at the prompt, and at what they generated
        rejected = {k: v for k, v in monitor.metrics().items() if "traces_rejected_total" in k and v}
        assert not rejected
    finally:
        monitor.process.stop()
