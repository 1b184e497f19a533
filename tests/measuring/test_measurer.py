"""The measurer: batched metrics give what trace-by-trace metrics give, and one trace's
failure costs no other trace its result."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

import monitor.measuring.measurer as measure_module
from monitor.core.detect import Detector, DetectorConfig
from monitor.errors import RejectReason
from monitor.measuring.measurer import Duplicate, Measured, Measurer, Rejected
from monitor.protocol.codec import encode
from monitor.protocol.model_contract import ContractTable
from monitor.protocol.records import Record
from tests.factories import CONTRACT, KEY_ID, KEYRING, SCOPES, SECRET, make_record, make_trace


def make_measurer() -> Measurer:
    contracts = ContractTable()
    contracts.add(CONTRACT)
    return Measurer(keyring=KEYRING, scopes=SCOPES, contracts=contracts,
                      detector=Detector(DetectorConfig(reference_traces=4)))


def mixed_records() -> list[Record]:
    """Two shapes, float16 and float32, a duplicate and a record that is not a trace."""
    values = [make_record(i, keys=32 if i % 3 else 48, dtype="float32" if i % 5 == 0 else "float16")
              for i in range(24)]
    values += [values[3], b"garbage"]
    return [Record("traces", 0, i, b"k", v) for i, v in enumerate(values)]


def test_a_batch_gives_what_one_trace_at_a_time_gives():
    records = mixed_records()
    batched = make_measurer().measure(records)
    single = make_measurer()
    one_by_one = [single.measure([r])[0] for r in records]
    assert [type(r) for r in batched] == [type(r) for r in one_by_one]
    assert [type(r) for r in batched][-2:] == [Duplicate, Rejected]
    for a, b in zip(batched, one_by_one, strict=True):
        if isinstance(a, Measured):
            assert isinstance(b, Measured)
            assert a.identity == b.identity
            for field in ("entropy", "concentration", "sink_share"):
                np.testing.assert_allclose(getattr(a.metrics, field), getattr(b.metrics, field), rtol=1e-6,
                                           atol=1e-9)
            assert float(a.metrics.diversity) == pytest.approx(float(b.metrics.diversity), rel=1e-6, abs=1e-9)
            assert [x.kind for x in a.anomalies] == [x.kind for x in b.anomalies]


def test_traces_of_close_key_counts_are_measured_together_with_what_each_gets_alone(monkeypatch):
    """A model server's traces follow each request's length: one call of the metrics
    core measures those of close key counts, padded, and the results do not change."""
    keys = [40, 37, 33, 40, 31, 36, 39, 34]
    records = [Record("traces", 0, i, b"k", make_record(i, keys=k)) for i, k in enumerate(keys)]
    calls = []
    real = measure_module.head_metrics

    def counted(weights, valid=None, **kwargs):
        calls.append(np.shape(weights))
        return real(weights, valid, **kwargs)

    monkeypatch.setattr(measure_module, "head_metrics", counted)
    together = make_measurer().measure(records)
    assert calls == [(8, *np.shape(make_trace(0, keys=40)[1])[:2], 40)]
    one_by_one = make_measurer()
    for record, a in zip(records, together, strict=True):
        (b,) = one_by_one.measure([record])
        assert isinstance(a, Measured) and isinstance(b, Measured)
        for field in ("entropy", "concentration", "sink_share"):
            np.testing.assert_allclose(getattr(a.metrics, field), getattr(b.metrics, field), rtol=1e-6, atol=1e-9)
        assert float(a.metrics.diversity) == pytest.approx(float(b.metrics.diversity), rel=1e-6, abs=1e-9)
        assert float(a.metrics.effective_heads) == pytest.approx(float(b.metrics.effective_heads), rel=1e-6)


def test_a_trace_whose_metrics_fail_is_rejected_alone(monkeypatch):
    records = [Record("traces", 0, i, b"k", make_record(i)) for i in range(5)]
    real = measure_module.head_metrics
    marked = []

    def flaky(weights, valid=None, **kwargs):
        if np.ndim(weights) == 4:
            raise FloatingPointError("simulated failure of the batch")
        if len(marked) == 1:  # the second trace measured on its own
            marked.append(True)
            raise FloatingPointError("simulated failure of one trace")
        marked.append(True)
        return real(weights, valid, **kwargs)

    monkeypatch.setattr(measure_module, "head_metrics", flaky)
    results = make_measurer().measure(records)
    assert [type(r) for r in results] == [Measured, Rejected, Measured, Measured, Measured]
    assert results[1].reason is RejectReason.MALFORMED
    assert results[1].header is not None  # the header verified; it goes to the dead letter


def test_value_faults_are_rejected_from_the_metrics_pass_with_decodes_reasons():
    """decode leaves the value checks to the metrics core here; a batch holding a NaN
    and a negative weight still gives every good trace its metrics and each bad one
    decode's own reason, with its header for the dead letter."""
    values = []
    for i in range(5):
        header, weights = make_trace(i, dtype="float32" if i == 3 else "float16")
        if i == 1:
            weights[1, 2, 0] = np.nan
        if i == 3:
            weights[0, 0, 0] = -0.25
        values.append(encode(header, weights, KEY_ID, SECRET))
    results = make_measurer().measure([Record("traces", 0, i, b"k", v) for i, v in enumerate(values)])
    assert [type(r) for r in results] == [Measured, Rejected, Measured, Rejected, Measured]
    assert (results[1].reason, results[3].reason) == (RejectReason.NON_FINITE, RejectReason.NEGATIVE)
    assert results[1].header is not None and results[3].header is not None


def test_mass_faults_in_a_batch_are_rejected_with_decodes_reasons_and_the_others_pass():
    """The batch's one-pass mass check lets through only traces the per-trace check
    would pass: a row short of its mass and weight on a hidden key are each refused
    with decode's reason, and the rest of the batch is measured."""
    values, expected = [], []
    for i in range(8):
        header, weights = make_trace(i, keys=32 - i % 3)  # padded to one batch
        reason = None
        if i == 2:
            weights[1, 0] *= np.float16(0.8)
            reason = RejectReason.ROW_SUM
        if i == 5:
            row = int(np.argmin(header.query_positions))
            hidden = header.key_count - 1
            assert header.query_positions[row] < hidden  # causal: the last key is hidden from this row
            weights[0, row] *= np.float16(0.5)
            weights[0, row, hidden] = np.float16(0.5)
            reason = RejectReason.MASKED_MASS
        values.append(encode(header, weights, KEY_ID, SECRET))
        expected.append(reason)
    results = make_measurer().measure([Record("traces", 0, i, b"k", v) for i, v in enumerate(values)])
    assert [r.reason if isinstance(r, Rejected) else None for r in results] == expected
    assert all(isinstance(r, Measured) for r, e in zip(results, expected, strict=True) if e is None)


def test_judging_a_chunk_together_gives_each_trace_its_own_verdict_around_a_duplicate():
    """The detector works out a chunk's traces together before judging them in order; a
    duplicate in the middle must not shift any trace onto another's numbers."""
    values = [make_record(i, layer=i % 2) for i in range(12)]
    values += [values[5]] + [make_record(100 + i, layer=1, collapse=0.9) for i in range(12)]
    values += [make_record(200 + i, layer=0) for i in range(3)]
    records = [Record("traces", 0, i, b"k", v) for i, v in enumerate(values)]
    together = make_measurer().measure(records)
    single = make_measurer()
    alone = [single.measure([r])[0] for r in records]
    assert [type(r) for r in together] == [type(r) for r in alone]
    assert isinstance(together[12], Duplicate)
    judged = [(a, b) for a, b in zip(together, alone, strict=True) if isinstance(a, Measured)]
    assert any(a.anomalies for a, _ in judged)
    for a, b in judged:
        assert isinstance(b, Measured) and a.identity == b.identity
        assert (a.verdict.judged_by, a.verdict.learning) == (b.verdict.judged_by, b.verdict.learning)
        assert same_findings(a.anomalies, b.anomalies)


def same_findings(ours, theirs) -> bool:
    """The same findings; their values may differ by float32 rounding (traces measured in
    one batch against one at a time)."""
    return len(ours) == len(theirs) and all(
        (a.kind, a.layer, a.heads, a.reference_revision, a.pages) == (b.kind, b.layer, b.heads, b.reference_revision,
                                                                       b.pages)
        and all(x == pytest.approx(y, rel=1e-5, abs=1e-6)
                for x, y in ((a.value, b.value), (a.reference, b.reference), (a.effect, b.effect), (a.score, b.score)))
        for a, b in zip(ours, theirs, strict=True))


def test_when_working_out_a_chunk_together_fails_each_trace_is_judged_alone(monkeypatch, caplog):
    records = [Record("traces", 0, i, b"k", make_record(i)) for i in range(8)]
    expected = make_measurer().measure(records)
    measurer = make_measurer()
    alone = measurer.detector.ahead

    def failing(observations):
        if len(observations) > 1:
            raise ValueError("simulated failure of the chunk")
        return alone(observations)

    monkeypatch.setattr(measurer.detector, "ahead", failing)
    got = measurer.measure(records)
    assert all(isinstance(r, Measured) for r in got)
    assert [(r.anomalies, r.verdict.learning, r.verdict.ready) for r in got] == [
        (r.anomalies, r.verdict.learning, r.verdict.ready) for r in expected]
    assert "judging 8 traces together failed unexpectedly" in caplog.text


def test_a_chunks_observations_cross_in_one_pickle_with_their_metrics_stacked():
    """What a measuring process hands the judge: every trace, rejection and field as it
    was, in order; each metric of the traces one array in the pickle."""
    records = [*mixed_records()[:12], Record("traces", 0, 100, b"k", b"garbage")]
    measurer = make_measurer()
    same_shape = measurer.observe(records)
    assert isinstance(same_shape, measure_module.ObservedChunk) and isinstance(same_shape[-1], Rejected)
    three = dataclasses.replace(same_shape[0], heads=("a", "b", "c"), metrics=dataclasses.replace(
        same_shape[0].metrics, entropy=np.zeros(3), concentration=np.ones(3), sink_share=np.zeros(3),
        similarity=np.eye(3)))
    mixed = measure_module.ObservedChunk([*same_shape, three])  # two head counts: each trace as it is
    for chunk in (same_shape, mixed):
        data = pickle.dumps(chunk, protocol=5)
        back = pickle.loads(data)
        assert type(back) is list and len(back) == len(chunk)
        for a, b in zip(chunk, back, strict=True):
            assert type(a) is type(b)
            if isinstance(a, Rejected):
                assert (a.reason, a.detail) == (b.reason, b.detail)
                continue
            for name in ("entropy", "concentration", "sink_share", "similarity", "diversity", "effective_heads"):
                assert np.array_equal(getattr(a.metrics, name), getattr(b.metrics, name), equal_nan=True)
            assert (a.metrics.row_mass, a.metrics.hidden_mass, b.metrics.row_mass) == (None, None, None)
            assert (a.identity, a.heads, a.seconds) == (b.identity, b.heads, b.seconds)
    stacked = pickle.dumps(same_shape, protocol=5)
    assert b"_unstack" in stacked and b"_unstack" not in pickle.dumps(mixed, protocol=5)
    assert len(stacked) < len(pickle.dumps(list(same_shape), protocol=5))
