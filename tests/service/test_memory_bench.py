"""The memory bench's traffic (``benchmarks/memory_bench.py``), without a broker: what it
produces is what the service accepts, each trace and request its own. The run itself
(60,000+ traces on the real broker) is a script, not a test: docs/performance.md has its
figures."""

from __future__ import annotations

from benchmarks.memory_bench import MODELS, PLAN, Traffic
from benchmarks.service_bench import KEY_ID, SECRET
from monitor.protocol.access import Keyring, ScopePolicy
from monitor.protocol.codec import decode
from monitor.protocol.model_contract import ContractTable


def test_the_traffic_decodes_under_its_contracts_with_a_trace_a_layer_and_fresh_ids():
    traffic = Traffic(keys=64, rows=4)
    table = ContractTable()
    for contract in traffic.contracts:
        table.add(contract)
    keyring, scopes = Keyring({KEY_ID: SECRET}), ScopePolicy.parse(["*:*"])
    requests, traces, revisions = set(), set(), set()
    for n in range(2 * len(PLAN)):
        request_id, values = traffic.request(n)
        assert len(values) == MODELS[n % len(MODELS)].layers
        decoded = [decode(v, keyring=keyring, scopes=scopes, contracts=table.get) for v in values]
        assert {t.header.request_id for t in decoded} == {request_id}
        assert [t.header.layer for t in decoded] == list(range(len(values)))
        assert all(t.weights.shape == (16, 4, 64) for t in decoded)
        requests.add(request_id)
        traces |= {t.header.trace_id for t in decoded}
        revisions |= {(t.header.model_id, t.header.model_revision) for t in decoded}
    assert len(requests) == 2 * len(PLAN)
    assert len(traces) == sum(MODELS[n % len(MODELS)].layers for n in range(2 * len(PLAN)))
    assert revisions == {(m.model_id, m.revision) for m in MODELS}
