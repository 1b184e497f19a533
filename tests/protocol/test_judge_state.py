"""Rounds of the judges' state: the latest round comes back as the states that went in,
records of earlier rounds (keys gone since) are left out, and a broken record is refused
with a reason."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from monitor.core.detect import Detector, DetectorConfig
from monitor.errors import RejectReason, TraceRejected
from monitor.protocol.judge_state import MARKER, encode_round, latest_round
from tests.core.test_detect import HEALTHY, SUNK, observations


def detector_after(requests: int) -> Detector:
    rng = np.random.default_rng(3)
    detector = Detector(DetectorConfig(reference_traces=5))
    for i, obs in enumerate([*observations(HEALTHY, rng, requests), *observations(SUNK, rng, requests)]):
        detector.observe(dataclasses.replace(obs, timestamp=100.0 + i))
    return detector


def test_the_latest_round_gives_back_the_states_that_went_in():
    detector = detector_after(8)
    states = [detector.key_state("scenario-lm", "r1"), detector.key_state("scenario-lm", "r3")]
    earlier = encode_round([detector.key_state("scenario-lm", "r1"), {**states[1], "judged_by": "r-gone"}], 40)
    records = [*earlier, *encode_round(states, 57)]
    assert records[-1][0] == MARKER
    assert all(len(value) < 1_000_000 for _, value in records)  # within a broker's default record size

    offset, back, incidents = latest_round(records)
    assert offset == 57 and incidents == []
    assert {s["judged_by"] for s in back} == {"r1", "r3"}  # r-gone was in the round at 40 only
    restored = Detector(DetectorConfig(reference_traces=5))
    for state in back:
        restored.restore_key(state)
    assert restored.references.keys() == detector.references.keys()
    assert restored.statistics().keys() == detector.statistics().keys()
    for key, statistic in detector.statistics().items():
        np.testing.assert_array_equal(restored.statistics()[key], statistic)


def test_no_round_and_a_broken_record():
    assert latest_round([]) is None
    assert latest_round(encode_round([], 9, [{"key": ["m", "r"]}])) == (9, [], [{"key": ["m", "r"]}])
    with pytest.raises(TraceRejected, match="judge state record") as refused:
        latest_round([(b"m\x00r\x000", b"{not json"), (MARKER, b'{"offset": 3}')])
    assert refused.value.reason is RejectReason.MALFORMED
