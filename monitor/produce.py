"""``attention-monitor produce --synthetic``: publish a synthetic model's contract,
signed traces and task outcomes to Kafka, for demos and smoke tests of a deployment."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import numpy as np
from kafka import KafkaProducer

from monitor.broker.producer import TraceProducer, publish_contract, send_outcome
from monitor.contract import Scope
from monitor.settings import Settings
from monitor.synthetic import SyntheticModel, layer_roles, make_header, sample_positions, trace_weights


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
    kafka = settings.kafka_config()
    rng = np.random.default_rng()
    plain = KafkaProducer(**kafka)
    publish_contract(plain, settings.contracts_topic, contract)
    plain.flush()
    sent = 0
    scope = Scope(tenant=traffic.tenant, data_class=traffic.data_class)
    with TraceProducer(key_id=key_id, secret=secret, topic=settings.traces_topic, **kafka) as traces:
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
                traces.send(header, weights)
                sent += 1
            failed = rng.random() < (0.3 if collapsing else 0.05)
            send_outcome(plain, settings.outcomes_topic, request_id, "failure" if failed else "success", time.time())
            delay = start + (i + 1) / traffic.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    plain.flush()
    plain.close()
    return sent
