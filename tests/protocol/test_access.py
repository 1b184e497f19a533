"""Keys bound to tenants, contracts accepted only from keys allowed to publish them."""

from __future__ import annotations

import json

import pytest

from monitor.errors import ConfigurationError, RejectReason, TraceRejected
from monitor.protocol.access import Key, Keyring, ScopePolicy, contract_verifier
from monitor.protocol.codec import decode, encode
from monitor.protocol.model_contract import ContractTable
from monitor.protocol.schema import Scope
from monitor.tools.synthetic import SyntheticModel
from tests.factories import CONTRACT, CONTRACTS, make_trace

TEAM_A = Key(b"team-a-secret-0123456789", frozenset({"team-a"}), contracts=True)
READER = Key(b"reader-secret-0123456789", frozenset({"*"}), contracts=False)
KEYRING = Keyring({"team-a": TEAM_A, "reader": READER})
SCOPES = ScopePolicy.parse(["*:internal"])


def signed(tenant: str, key_id: str = "team-a", secret: bytes = TEAM_A.secret) -> bytes:
    header, weights = make_trace(0, scope=Scope(tenant=tenant, data_class="internal"))
    return encode(header, weights, key_id, secret)


def test_a_key_signs_only_its_tenants_traces():
    assert decode(signed("team-a"), keyring=KEYRING, scopes=SCOPES, contracts=CONTRACTS).key_id == "team-a"
    with pytest.raises(TraceRejected) as refused:
        decode(signed("team-b"), keyring=KEYRING, scopes=SCOPES, contracts=CONTRACTS)
    assert refused.value.reason is RejectReason.SCOPE_DENIED
    assert "key 'team-a' may not sign traces of tenant 'team-b'" in refused.value.detail
    # a key for any tenant still needs the monitor's own scopes
    assert decode(signed("team-b", "reader", READER.secret), keyring=KEYRING, scopes=SCOPES,
                  contracts=CONTRACTS).header.scope.tenant == "team-b"


def test_the_keyring_file_forms():
    ring = Keyring.from_json(json.dumps({"a": {"secret": "s" * 20, "tenants": ["t1", "t2"], "contracts": True},
                                         "old": "o" * 20}))
    assert ring.key("a") == Key(b"s" * 20, frozenset({"t1", "t2"}), True)
    assert ring.legacy == ["old"] and ring.key("old").may_sign("anyone")
    for bad in ({"a": {"secret": "s" * 20}}, {"a": {"secret": "s" * 20, "tenants": []}},
                {"a": {"secret": "short", "tenants": ["t"]}}, ["not", "an", "object"]):
        with pytest.raises(ConfigurationError):
            Keyring.from_json(json.dumps(bad))


def test_contracts_are_accepted_only_signed_by_a_key_allowed_to_publish_them():
    table = ContractTable(contract_verifier(KEYRING), max_contracts=2)
    attempts = ((None, None, "unsigned"), ("stranger", b"x" * 20, "unknown_key"),
                ("reader", READER.secret, "not_allowed"), ("team-a", b"forged-secret-000", "bad_signature"))
    for key_id, secret, why in attempts:
        assert table.apply(*ContractTable.record(CONTRACT, key_id, secret)) is None
        assert table.refusals[why] == 1, why
    assert table.apply(*ContractTable.record(CONTRACT, "team-a", TEAM_A.secret)) == CONTRACT.contract_id
    assert table.get(CONTRACT.contract_id) == CONTRACT
    _, value = ContractTable.record(CONTRACT, "team-a", TEAM_A.secret)
    assert table.apply(b"another-id", value) is None and table.refusals["id_mismatch"] == 1
    for revision in ("r2", "r3"):  # bounded: the oldest goes
        other = SyntheticModel("test-model", revision, layers=1).contract()
        table.apply(*ContractTable.record(other, "team-a", TEAM_A.secret))
    assert len(table) == 2 and table.evicted == 1 and table.get(CONTRACT.contract_id) is None
