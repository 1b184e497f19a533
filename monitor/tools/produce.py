"""``attention-monitor produce --synthetic``: publish a synthetic model's contract,
signed traces and task outcomes to Kafka, for demos and smoke tests of a deployment."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from monitor.producer import Scope, TraceProducer
from monitor.protocol.access import Key, ScopePolicy
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


def refusal(key: Key, key_id: str, tenant: str, data_class: str, allowed_scopes: Sequence[str]) -> str | None:
    """Why the monitor would refuse every trace or the contract signed with ``key`` at
    this scope (None when it would not): checked before anything is sent, since the
    monitor only counts its refusals (``scope_denied``, ``unknown_contract``). The scopes
    checked are this process's ALLOWED_SCOPES, when set: the same settings as ``run``'s."""
    if not key.may_sign(tenant):
        return (f"key {key_id} may sign traces of {', '.join(sorted(key.tenants))} only, not of tenant {tenant}: "
                f"the monitor would refuse every trace (scope_denied). Pass --tenant {sorted(key.tenants)[0]} (and "
                "the --data-class ALLOWED_SCOPES allows), or sign with a key of that tenant "
                f"(attention-monitor keyring new FILE --key-id {tenant} --tenant {tenant})")
    if not key.contracts:
        return (f"key {key_id} may not publish model contracts (--no-contracts): the monitor would refuse the "
                "synthetic model's contract, then every trace (unknown_contract). Sign with a key that may")
    if allowed_scopes and not ScopePolicy.parse(allowed_scopes).permits(Scope(tenant=tenant, data_class=data_class)):
        return (f"ALLOWED_SCOPES ({','.join(allowed_scopes)}) does not allow {tenant}:{data_class}: a monitor with "
                f"these settings would refuse every trace (scope_denied). Add {tenant}:{data_class} to it, or pass "
                "the --tenant and --data-class it allows")
    return None


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
