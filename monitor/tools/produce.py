"""``attention-monitor produce --synthetic``: publish a synthetic model's contract,
signed traces and task outcomes to Kafka, for demos and smoke tests of a deployment."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import numpy as np

from monitor.producer import Scope, TraceProducer
from monitor.settings import Settings
from monitor.tools.synthetic import SyntheticModel, layer_roles, make_header, sample_positions, trace_weights


@dataclass(frozen=True)
class SyntheticTraffic:
    model_id: str = "demo-lm"
    revision: str = "rev-1"
    requests: int = 1000
    rate: float = 20.0  #: requests per second (each gives one trace per layer)
    collapse_layer: int | None = None
    collapse: float = 0.9
    collapse_after: int = 0  #: requests before the collapse starts
    tenant: str = "demo"
    data_class: str = "synthetic"


def produce_synthetic(settings: Settings, traffic: SyntheticTraffic, key_id: str, secret: bytes) -> int:
    """Publish the traffic; returns the number of traces sent."""
    model = SyntheticModel(traffic.model_id, traffic.revision)
    contract = model.contract()
    rng = np.random.default_rng()
    sent = 0
    scope = Scope(tenant=traffic.tenant, data_class=traffic.data_class)
    with TraceProducer(key_id=key_id, secret=secret, topics=settings.topics(),
                       **settings.kafka_connection().kafka_python()) as producer:
        producer.publish_contract(contract).get(timeout=30)
        start = time.monotonic()
        for i in range(traffic.requests):
            request_id = uuid.uuid4().hex
            collapsing = traffic.collapse_layer is not None and i >= traffic.collapse_after
            for layer in range(model.layers):
                keys = int(rng.integers(64, 256))
                positions = sample_positions(rng, keys, 8)
                drift = traffic.collapse if collapsing and layer == traffic.collapse_layer else 0.0
                weights = trace_weights(rng, layer_roles(layer, model.heads), positions, keys, collapse=drift)
                header = make_header(contract, layer, positions, keys, request_id=request_id, scope=scope,
                                     producer_id="attention-monitor-produce", timestamp=time.time())
                producer.send(header, weights)
                sent += 1
            failed = rng.random() < (0.3 if collapsing else 0.05)
            producer.send_outcome(request_id, "failure" if failed else "success")
            delay = start + (i + 1) / traffic.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    return sent
