"""The observations topic's records: a judge reading them reaches exactly the verdicts
of judging the measured traces in-process, and a record it cannot read is refused with
a reason, never a crash."""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np
import pytest

from monitor.core.detect import Detector, DetectorConfig
from monitor.core.outcome import Outcome
from monitor.errors import RejectReason, TraceRejected
from monitor.measuring.measurer import Measurer, Observed
from monitor.protocol.codec import encode as encode_trace
from monitor.protocol.model_contract import ContractTable
from monitor.protocol.observations import Forwarded, decode, encode, encode_within, judge_key, parse_key
from monitor.protocol.records import Record
from monitor.tools.scenario import Fault, Scenario
from tests.factories import KEY_ID, KEYRING, SCOPES, SECRET

HEALTHY = Scenario(revision="rev-1")
COLLAPSED = Scenario(revision="rev-2", faults=(Fault("collapse", 2, (1, 2, 3, 4)),))


def measured(scenario: Scenario, requests: int, seed: int) -> list[Observed]:
    contracts = ContractTable()
    contracts.add(scenario.contract())
    measurer = Measurer(keyring=KEYRING, scopes=SCOPES, contracts=contracts, detector=Detector())
    rng = np.random.default_rng(seed)
    traces = [pair for i in range(requests) for pair in scenario.request(rng, f"{scenario.revision}-{i}")]
    records = [Record("traces", 0, offset, None, encode_trace(header, weights, KEY_ID, SECRET))
               for offset, (header, weights) in enumerate(traces)]
    observed = [o for o in measurer.observe(records) if isinstance(o, Observed)]
    assert len(observed) == len(records)
    return observed


def forwarded(items: list[Observed]) -> list[Forwarded]:
    return [Forwarded(o.identity, o.heads, o.metrics, Outcome("failure" if i % 3 == 0 else "success"))
            for i, o in enumerate(items)]


def test_a_judge_reading_the_records_reaches_the_in_process_verdicts():
    traffic = measured(HEALTHY, 60, seed=0) + measured(COLLAPSED, 20, seed=1)
    config = DetectorConfig(reference_traces=40, pins={("scenario-lm", "rev-2"): "rev-1"})
    here, there = Detector(config), Detector(config)
    expected = [here.observe(o.observation()) for o in traffic]

    got, entries = [], forwarded(traffic)
    for at in range(0, len(entries), 7):  # as transactions would group them
        record = encode(entries[at: at + 7])
        back = decode(record)
        assert [(b.identity, b.heads, b.outcome) for b in back] == \
            [(e.identity, e.heads, e.outcome) for e in entries[at: at + 7]]
        got += [there.observe(b.observation()) for b in back]

    assert any(v.anomalies for v in expected)  # the fault is found: the comparison means something
    assert [(v.ready, v.reference_traces, v.judged_by, v.anomalies) for v in got] == \
        [(v.ready, v.reference_traces, v.judged_by, v.anomalies) for v in expected]
    for key, statistic in here.statistics().items():
        np.testing.assert_array_equal(there.statistics()[key], statistic)


def test_metrics_travel_bit_for_bit_and_absent_masses_as_nan():
    (entry,) = forwarded(measured(HEALTHY, 1, seed=2)[:1])
    (back,) = decode(encode([entry]))
    for name in ("entropy", "concentration", "sink_share", "similarity", "diversity", "effective_heads",
                 "prompt_mass", "learned_sink"):  # NaN equals NaN here
        np.testing.assert_array_equal(np.asarray(getattr(back.metrics, name)),
                                      np.asarray(getattr(entry.metrics, name), np.float64))
    assert np.isnan(back.metrics.prompt_mass).all()  # a prompt-only trace says nothing of it
    (absent,) = decode(encode([Forwarded(entry.identity, entry.heads, dataclasses.replace(
        entry.metrics, prompt_mass=None, learned_sink=None), entry.outcome)]))
    assert np.isnan(absent.metrics.prompt_mass).all() and np.isnan(absent.metrics.learned_sink).all()


def test_the_key_names_the_model_and_the_judging_revision():
    assert parse_key(judge_key("llama", "rev-1")) == ("llama", "rev-1")
    with pytest.raises(ValueError, match="NUL"):
        judge_key("llama\x00", "rev-1")
    with pytest.raises(TraceRejected, match="is not a model id and a revision"):
        parse_key(b"only-a-model")


@pytest.mark.parametrize(("mangle", "says"), [
    (lambda v: v[:5], "shorter than the 9-byte prefix"),
    (lambda v: b"XXXX" + v[4:], "magic"),
    (lambda v: v[:4] + b"\x07" + v[5:], "version 7 is not 1"),
    (lambda v: v[:-8], "bytes of metrics where the header's head counts make"),
    (lambda v: v + b"\x00" * 8, "bytes of metrics where the header's head counts make"),
    (lambda v: v[:9] + b"}" + v[10:], "unreadable header"),
    (lambda v: _with_header(v, {"entries": [{"heads": ["h"] * 8}]}), "identity is incomplete"),
    (lambda v: _with_header(v, {"items": []}), "unreadable header"),
    (lambda v: v.replace(b'"outcome":"failure"', b'"outcome":"maybe!!"'), "outcome 'maybe!!' is none of"),
    (lambda v: None, "0 bytes"),
])
def test_a_record_it_cannot_read_is_refused_as_malformed_naming_why(mangle, says):
    value = encode(forwarded(measured(HEALTHY, 1, seed=3)[:1]))
    with pytest.raises(TraceRejected, match=says) as refused:
        decode(mangle(value))
    assert refused.value.reason is RejectReason.MALFORMED


def _with_header(value: bytes, header: dict) -> bytes:
    (size,) = struct.unpack_from(">I", value, 5)
    text = json.dumps(header).encode()
    return value[:5] + struct.pack(">I", len(text)) + text + value[9 + size:]


def test_a_keys_traces_take_as_many_records_as_keep_each_within_the_limit():
    entries = forwarded(measured(HEALTHY, 40, seed=4))  # 160 traces of 8 heads, about 1.3 KB each
    values = encode_within(entries, limit=16 * 1024)
    assert len(values) > 1 and all(len(v) <= 16 * 1024 for v in values)
    back = [e for v in values for e in decode(v)]
    assert [(e.identity.trace_id, e.outcome) for e in back] == [(e.identity.trace_id, e.outcome) for e in entries]
    assert len(encode_within(entries[:1], limit=10)) == 1  # one trace beyond the limit still travels


def test_a_judge_judges_by_the_revision_its_record_key_names_whatever_its_own_pins():
    """The instance that routed a canary's traces decided which revision judges them; a
    judge whose own pins say otherwise (it never had the setting) obeys the key, so the
    canary is judged by the pinned reference and never learns one of its own."""
    from monitor.protocol.observations import read

    judge = Detector(DetectorConfig(reference_traces=40))  # no pins of its own
    for o in measured(HEALTHY, 40, seed=0):
        judge.observe(o.observation())
    canary = forwarded(measured(COLLAPSED, 20, seed=1))  # a 40-trace reference: thresholds allow for its error
    key, entries = read(judge_key("scenario-lm", "rev-1"), encode(canary))
    assert key == ("scenario-lm", "rev-1") and {e.judged_by for e in entries} == {"rev-1"}
    verdicts = [judge.observe(e.observation()) for e in entries]
    assert {v.judged_by for v in verdicts} == {"rev-1"} and not any(v.learning for v in verdicts)
    assert any(v.anomalies for v in verdicts)
    assert not [k for k in judge.references if k[1] == "rev-2"]
    with pytest.raises(TraceRejected, match="another model"):
        read(judge_key("other-lm", "rev-1"), encode(canary))
