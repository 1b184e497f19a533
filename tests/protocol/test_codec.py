"""encode/decode: round trips, every reject reason, fuzzing, tamper detection."""

from __future__ import annotations

import json
import signal
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monitor.errors import RejectReason, TraceRejected
from monitor.protocol import wire
from monitor.protocol.codec import Limits, decode, encode, named_contract, valid_keys
from monitor.protocol.dead_letter import dead_letter
from monitor.protocol.schema import Scope
from monitor.tools.synthetic import make_header
from tests.factories import (
    CONTRACT,
    CONTRACTS,
    KEY_ID,
    KEYRING,
    SCOPES,
    SECRET,
    decode_default,
    make_record,
    make_trace,
)


def reject_reason(data: bytes, **kwargs) -> RejectReason:
    with pytest.raises(TraceRejected) as info:
        decode(data, keyring=kwargs.pop("keyring", KEYRING), scopes=kwargs.pop("scopes", SCOPES),
               contracts=kwargs.pop("contracts", CONTRACTS), **kwargs)
    return info.value.reason


def test_round_trip_keeps_header_and_weights():
    header, weights = make_trace(3, layer=1, keys=40, rows=5)
    trace = decode_default(encode(header, weights, KEY_ID, SECRET))
    assert trace.header == header
    np.testing.assert_array_equal(trace.weights, weights)
    assert trace.contract is CONTRACT and trace.layer.layer == 1 and trace.key_id == KEY_ID
    np.testing.assert_array_equal(trace.valid, valid_keys(header))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), keys=st.integers(2, 64), rows=st.integers(1, 8),
       dtype=st.sampled_from(["float16", "float32"]), layer=st.integers(0, 1))
def test_round_trip_property(seed, keys, rows, dtype, layer):
    header, weights = make_trace(seed, layer=layer, keys=keys, rows=rows, dtype=dtype)
    trace = decode_default(encode(header, weights, KEY_ID, SECRET))
    assert trace.header == header
    assert trace.weights.dtype == weights.dtype
    np.testing.assert_array_equal(trace.weights, weights)


def test_no_weight_is_written_as_text():
    header, weights = make_trace(1)
    record = encode(header, weights, KEY_ID, SECRET)
    frame = wire.unpack(record, 1 << 30, 1 << 20)
    assert bytes(frame.payload) == weights.astype("<f2").tobytes()
    assert "weights" not in json.loads(bytes(frame.header))


def resign(body: bytes, secret: bytes = SECRET) -> bytes:
    import hashlib
    import hmac
    return body + hmac.new(secret, body, hashlib.sha256).digest()


def rebuild(header_doc: dict, payload: bytes) -> bytes:
    return wire.pack(json.dumps(header_doc).encode(), payload, KEY_ID, SECRET)


def parts(seed=0, **kwargs):
    header, weights = make_trace(seed, **kwargs)
    return json.loads(header.model_dump_json()), weights


def test_every_reject_reason_with_a_crafted_input():
    good = make_record()
    doc, weights = parts()
    payload = weights.tobytes()
    cases = {}
    cases[RejectReason.MALFORMED] = [b"", b"garbage" * 10, good[:20], good[:40],
                                     wire.pack(b"{not json", payload, KEY_ID, SECRET),
                                     rebuild({**doc, "layer": "three"}, payload)]
    cases[RejectReason.UNKNOWN_SCHEMA_VERSION] = [resign(good[:4] + b"\x02" + good[5:-32]),
                                                  rebuild({**doc, "schema_version": 7}, payload)]
    cases[RejectReason.OVERSIZED] = [good + b"\x00" * 100]  # with a small record limit, below
    cases[RejectReason.UNSIGNED] = [wire.pack(json.dumps(doc).encode(), payload, None, None)]
    # A signed record cut short loses its real MAC: indistinguishable from tampering.
    cases[RejectReason.BAD_SIGNATURE] = [good[:-1] + bytes([good[-1] ^ 1]), good[:-40],
                                         wire.pack(json.dumps(doc).encode(), payload, KEY_ID, b"x" * 32)]
    cases[RejectReason.UNKNOWN_KEY] = [wire.pack(json.dumps(doc).encode(), payload, "stranger", SECRET)]
    cases[RejectReason.SCOPE_DENIED] = [rebuild({**doc, "scope": {"tenant": "other", "data_class": "pii"}}, payload)]
    cases[RejectReason.SHAPE_MISMATCH] = [rebuild(doc, payload[:-2]), rebuild({**doc, "dtype": "float32"}, payload)]
    cases[RejectReason.UNKNOWN_CONTRACT] = [rebuild({**doc, "contract_id": "attention-model-contract@sha256:00"},
                                                    payload)]
    cases[RejectReason.CONTRACT_MISMATCH] = [rebuild({**doc, "model_revision": "rev-9"}, payload),
                                             rebuild({**doc, "layer": 7}, payload),
                                             rebuild({**doc, "mask": "bidirectional"}, payload)]
    cases[RejectReason.HEAD_MISMATCH] = [rebuild({**doc, "heads": ["head-0", "head-0", "head-2", "head-3"]}, payload),
                                         rebuild({**doc, "heads": ["head-1", "head-0", "head-2", "head-3"]}, payload)]
    cases[RejectReason.KV_GROUP_MISMATCH] = [rebuild({**doc, "kv_groups": [0, 1, 0, 1]}, payload)]
    nan = weights.copy()
    nan[1, 2, 0] = np.nan
    neg = weights.copy()
    neg[0, 0, 0] = -0.25
    cases[RejectReason.NON_FINITE] = [rebuild(doc, nan.tobytes())]
    cases[RejectReason.NEGATIVE] = [rebuild(doc, neg.tobytes())]
    leaky = weights.copy()
    leaky[2, 0, -1] = 0.2  # row 0 is not the last position: the causal mask hides the last key
    cases[RejectReason.MASKED_MASS] = [rebuild(doc, leaky.tobytes())]
    heavy = weights.copy()
    heavy[3, -1] *= 1.2
    cases[RejectReason.ROW_SUM] = [rebuild(doc, heavy.tobytes())]
    assert set(cases) == set(RejectReason) - {RejectReason.UNSUPPORTED_DTYPE}
    for reason, records in cases.items():
        limits = Limits(max_record_bytes=len(good)) if reason is RejectReason.OVERSIZED else None
        for record in records:
            assert reject_reason(record, limits=limits) is reason, (reason, record[:40])
    assert reject_reason(good, limits=Limits(dtypes=frozenset({"float32"}))) is RejectReason.UNSUPPORTED_DTYPE
    assert reject_reason(good, limits=Limits(max_heads=2)) is RejectReason.OVERSIZED


def test_padding_semantics():
    header, weights = make_trace(5, keys=16, rows=3)
    doc = json.loads(header.model_dump_json())
    padded = {**doc, "padding": 4, "padding_side": "left"}
    # Weight on left-padded keys is mass the mask hides.
    assert reject_reason(rebuild(padded, weights.tobytes())) is RejectReason.MASKED_MASS
    from monitor.protocol.schema import TraceHeader
    visible = valid_keys(TraceHeader.model_validate(padded))
    assert not visible[:, :4].any()


@pytest.mark.parametrize("mask", ["causal", "bidirectional"])
@pytest.mark.parametrize(("padding", "side"), [(0, "right"), (3, "left"), (3, "right")])
def test_visible_keys_follow_the_mask_and_the_padding(mask, padding, side):
    from monitor.protocol.schema import TraceHeader
    header, _ = make_trace(2, keys=12, rows=4)
    doc = {**json.loads(header.model_dump_json()), "mask": mask, "padding": padding, "padding_side": side}
    h = TraceHeader.model_validate(doc)
    padded = set(range(padding)) if side == "left" else set(range(12 - padding, 12))
    expected = [[(mask == "bidirectional" or key <= row) and key not in padded for key in range(12)]
                for row in h.query_positions]
    for _ in range(2):  # the second call returns the mask kept from the first
        visible = valid_keys(h)
        np.testing.assert_array_equal(visible, np.array(expected))
        with pytest.raises(ValueError, match="read-only"):
            visible[:] = False  # shared by the traces of the same fields: nobody may change it


def test_rejections_after_the_signature_carry_the_header_for_the_dead_letter():
    doc, weights = parts()
    record = rebuild({**doc, "scope": {"tenant": "other", "data_class": "pii"}}, weights.tobytes())
    with pytest.raises(TraceRejected) as info:
        decode_default(record)
    letter = dead_letter(info.value.reason, info.value.detail, topic="t", partition=1, offset=9, record=record,
                         key=b"req", header=info.value.header)
    assert letter["reason"] == "scope_denied" and letter["verified_header"]["tenant"] == "other"
    text = json.dumps(letter)
    assert "query_positions" not in text and len(text) < 2000  # no weights, nothing bulky
    unsigned = dead_letter(RejectReason.BAD_SIGNATURE, "x", topic="t", partition=0, offset=0, record=b"abc",
                           key=None)
    assert unsigned["verified_header"] is None and unsigned["record_sha256"]


def test_flipping_any_single_byte_of_a_signed_record_is_detected():
    header, weights = make_trace(2, keys=8, rows=2)
    record = bytearray(encode(header, weights, KEY_ID, SECRET))
    for i in range(len(record)):
        for bit in (0x01, 0x80):
            record[i] ^= bit
            with pytest.raises(TraceRejected):
                decode_default(bytes(record))
            record[i] ^= bit
    decode_default(bytes(record))  # and the original still decodes


def _mutations(rng: np.random.Generator, seeds: list[bytes], n: int):
    for i in range(n):
        kind = i % 5
        if kind == 0:
            yield rng.bytes(int(rng.integers(0, 400)))
            continue
        base = bytearray(seeds[int(rng.integers(0, len(seeds)))])
        if kind == 1:  # flip random bytes
            for _ in range(int(rng.integers(1, 8))):
                base[int(rng.integers(0, len(base)))] = int(rng.integers(0, 256))
        elif kind == 2:  # truncate or extend
            cut = int(rng.integers(0, len(base)))
            base = base[:cut] if rng.random() < 0.5 else base + rng.bytes(cut % 50)
        elif kind == 3:  # absurd lengths in the frame
            base[6] = int(rng.integers(0, 256))
            pos = 7 + base[6] if 7 + base[6] + 4 <= len(base) else 7
            struct.pack_into("<I", base, pos, int(rng.integers(0, 2**32)))
        else:  # valid signature over a corrupted body
            body = bytes(base[:-32])
            j = int(rng.integers(0, len(body)))
            body = body[:j] + bytes([int(rng.integers(0, 256))]) + body[j + 1:]
            base = bytearray(resign(body))
        yield bytes(base)


def test_fuzz_only_the_reject_error_escapes_without_hanging_or_growing():
    rng = np.random.default_rng(1234)
    seeds = [make_record(s, keys=int(k), rows=3) for s, k in enumerate((8, 33, 64))]
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(AssertionError("decode hung")))
    tracemalloc.start()
    outcomes: dict[str, int] = {}
    try:
        for data in _mutations(rng, seeds, 10_000):
            signal.alarm(5)
            try:
                named = named_contract(data)  # never raises either
                assert named is None or isinstance(named, str)
                decode_default(data)
                outcomes["accepted"] = outcomes.get("accepted", 0) + 1
            except TraceRejected as exc:
                outcomes[exc.reason.value] = outcomes.get(exc.reason.value, 0) + 1
            finally:
                signal.alarm(0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sum(outcomes.values()) == 10_000
    assert peak < 8 * 1024 * 1024, f"peak traced memory {peak} bytes"
    assert {"malformed", "bad_signature"} <= outcomes.keys(), outcomes


def test_encode_refuses_weights_that_disagree_with_the_header():
    header, weights = make_trace(0)
    with pytest.raises(ValueError, match="header says float16"):
        encode(header, weights.astype(np.float32), KEY_ID, SECRET)
    with pytest.raises(ValueError, match="shape"):
        encode(header, weights[:, :2], KEY_ID, SECRET)


def test_scope_wildcards():
    header, weights = make_trace(0)
    rng = np.random.default_rng(0)
    positions = np.array(header.query_positions)
    for tenant, data_class, ok in (("acme", "anything", True), ("demo", "synthetic", True), ("demo", "pii", False)):
        h = make_header(CONTRACT, 0, positions, header.key_count, scope=Scope(tenant=tenant, data_class=data_class))
        record = encode(h, weights, KEY_ID, SECRET)
        if ok:
            decode_default(record)
        else:
            assert reject_reason(record) is RejectReason.SCOPE_DENIED
    del rng


def test_named_contract_reads_the_header_unverified_and_never_raises():
    record = make_record(0)
    assert named_contract(record) == CONTRACT.contract_id
    frame = wire.unpack(record, 1 << 30, 1 << 20)
    tampered = bytearray(record)
    tampered[-1] ^= 0xFF  # a bad signature: still named (decode rejects it)
    assert named_contract(bytes(tampered)) == CONTRACT.contract_id

    def with_header(doc: bytes) -> bytes:
        return wire.pack(doc, bytes(frame.payload), KEY_ID, SECRET)

    assert named_contract(with_header(b'{"contract_id": "other"}')) == "other"
    # what the byte scan leaves to the JSON parser: escapes, and a key given twice
    assert named_contract(with_header(b'{"contract_id": "a\\u0041\\"b"}')) == 'aA"b'
    assert named_contract(with_header(b'{"contract_id": "first", "contract_id": "last"}')) == "last"
    assert named_contract(with_header(b'{"note": "contract_id", "contract_id": "c"}')) == "c"
    # a header that is no JSON beyond the pair still names its contract: decode rejects the record
    assert named_contract(with_header(b'{"contract_id": "c", broken')) == "c"
    for doc in (b"[1, 2]", b'{"contract_id": 7}', b"{not json", b"\xff\xfe", b'{"layer": 0}'):
        assert named_contract(with_header(doc)) is None, doc
    assert named_contract(b"not a trace record") is None
    assert named_contract(None) is None
    assert named_contract(record, Limits(max_record_bytes=len(record) - 1)) is None
