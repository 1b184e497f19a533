"""What decode checks of generation traces, windowed layers and learned sinks: a row sees
only its window; a learned sink's mass travels beside the weights and rows sum to one
with it; header and contract must agree on both; a generation trace's decoding rows are
checked like the others, and its head metrics are its prompt rows' while its prompt mass
is its decoding rows'."""

from __future__ import annotations

import numpy as np
import pytest

from monitor.core.detect import Detector, DetectorConfig
from monitor.core.metrics import head_metrics
from monitor.errors import RejectReason, TraceRejected
from monitor.measuring.measurer import Measured, Measurer, Rejected
from monitor.protocol import wire
from monitor.protocol.codec import decode, encode, valid_keys
from monitor.protocol.model_contract import ContractTable
from monitor.protocol.records import Record
from monitor.tools.synthetic import make_header
from tests.factories import CONTRACT, KEY_ID, KEYRING, SCOPES, SECRET

WINDOWED = CONTRACT.model_copy(update={"layers": tuple(
    layer.model_copy(update={"window": 3, "learned_sink": True}) for layer in CONTRACT.layers)})


def header(contract, positions, keys, **fields):
    h = make_header(contract, 0, np.array(positions), keys)
    return h.model_copy(update=fields)


def rows_over(valid, rng, heads=4, scale=None):
    """Random weights over each row's valid keys, each row summing to ``scale`` (or 1)."""
    w = rng.random((heads, *valid.shape)) * valid
    w /= w.sum(-1, keepdims=True)
    if scale is not None:
        w *= scale[..., None]
    return w.astype(np.float16)


def decoded(h, weights, sink=None, contract=WINDOWED):
    return decode(encode(h, weights, KEY_ID, SECRET, sink), keyring=KEYRING, scopes=SCOPES,
                  contracts={contract.contract_id: contract})


def test_a_windowed_row_with_a_learned_sink_is_accepted_and_what_it_may_not_see_is_refused():
    rng = np.random.default_rng(0)
    h = header(WINDOWED, [1, 4, 7], 8, window=3, learned_sink=True)
    valid = valid_keys(h)
    assert valid.tolist()[2] == [False] * 5 + [True] * 3  # position 7 sees keys 5, 6, 7
    sink = rng.uniform(0.1, 0.9, (4, 3))
    weights = rows_over(valid, rng, scale=1 - sink)
    trace = decoded(h, weights, sink.astype(np.float16))
    assert trace.sink is not None and trace.sink.shape == (4, 3)
    outside = weights.copy()
    outside[:, 2, 0] = 0.2  # a key beyond the window
    with pytest.raises(TraceRejected) as refused:
        decoded(h, outside, sink.astype(np.float16))
    assert refused.value.reason is RejectReason.MASKED_MASS
    with pytest.raises(TraceRejected) as refused:  # the sink's mass missing: rows do not sum to one
        decoded(h, weights, np.zeros((4, 3), np.float16))
    assert refused.value.reason is RejectReason.ROW_SUM
    with pytest.raises(TraceRejected) as refused:  # a header that forgets what its contract says
        decoded(h.model_copy(update={"window": None}), weights, sink.astype(np.float16))
    assert refused.value.reason is RejectReason.CONTRACT_MISMATCH and "window" in refused.value.detail
    with pytest.raises(ValueError, match="exactly when the header says learned_sink"):
        encode(h, weights, KEY_ID, SECRET)


def test_a_record_whose_header_promises_a_sink_mass_it_lacks_is_a_shape_mismatch():
    rng = np.random.default_rng(1)
    h = header(WINDOWED, [1, 4, 7], 8, window=3, learned_sink=True)
    weights = rows_over(valid_keys(h), rng)
    record = wire.pack(h.model_dump_json(exclude_defaults=True).encode(), weights.tobytes(), KEY_ID, SECRET)
    with pytest.raises(TraceRejected) as refused:
        decode(record, keyring=KEYRING, scopes=SCOPES, contracts={WINDOWED.contract_id: WINDOWED})
    assert refused.value.reason is RejectReason.SHAPE_MISMATCH and "learned sink" in refused.value.detail


def test_a_generation_trace_measures_its_prompt_rows_and_looks_back_with_its_decoding_rows():
    rng = np.random.default_rng(2)
    h = header(CONTRACT, [1, 3, 5, 6, 8, 11], 12, prompt_length=6)
    valid = valid_keys(h)
    weights = rows_over(valid, rng)
    table = ContractTable()
    table.add(CONTRACT)
    measurer = Measurer(keyring=KEYRING, scopes=SCOPES, contracts=table, detector=Detector(DetectorConfig()))
    (result,) = measurer.measure([Record("traces", 0, 0, b"k", encode(h, weights, KEY_ID, SECRET))])
    assert isinstance(result, Measured)
    prompt = head_metrics(weights[:, :3], valid[:3])  # the classic metrics: the prompt rows'
    np.testing.assert_allclose(result.metrics.entropy, prompt.entropy, rtol=1e-5)
    np.testing.assert_allclose(result.metrics.similarity, prompt.similarity, rtol=1e-5)
    w = weights.astype(np.float64)[:, 3:] * valid[3:]
    expected = (w[..., :6].sum(-1) / w.sum(-1)).mean(-1)  # the decoding rows' share on the prompt
    np.testing.assert_allclose(result.metrics.prompt_mass, expected, rtol=1e-6)
    assert np.isnan(result.metrics.learned_sink).all()
    broken = weights.copy()
    broken[:, 5] *= 0.5  # a decoding row that no longer sums to one: checked like any row
    (refused,) = measurer.measure([Record("traces", 0, 1, b"k", encode(h.model_copy(update={"trace_id": "other"}),
                                                                       broken, KEY_ID, SECRET))])
    assert isinstance(refused, Rejected) and refused.reason is RejectReason.ROW_SUM
