from __future__ import annotations

import math

import numpy as np
import pytest

from monitor.core.detect import Detector, DetectorConfig, Observation, cusum_threshold, length_bucket
from monitor.core.metrics import head_metrics
from monitor.tools.synthetic import layer_roles, sample_positions, trace_weights

HEADS = tuple(f"head-{i}" for i in range(6))


def observe(rng, detector, *, revision="r1", collapse=0.0, keys=64, layer=1, model="m"):
    positions = sample_positions(rng, keys, 6)
    w = trace_weights(rng, layer_roles(layer, len(HEADS)), positions, keys, collapse=collapse)
    valid = np.arange(keys)[None, :] <= positions[:, None]
    m = head_metrics(w, valid)
    return detector.observe(Observation(model, revision, layer, keys, HEADS, m.entropy, m.concentration,
                                        m.sink_share, m.similarity, float(m.diversity)))


def test_threshold_matches_siegmund_and_grows_with_the_run_length():
    k = 0.5
    h = cusum_threshold(10_000, k)
    b = h + 1.166
    assert (math.exp(2 * k * b) - 2 * k * b - 1) / (2 * k * k) == pytest.approx(10_000, rel=1e-6)
    assert cusum_threshold(100_000, k) > h > cusum_threshold(1_000, k)


def test_length_buckets():
    assert [length_bucket(n) for n in (1, 3, 4, 15, 16, 63, 64, 4096)] == [0, 0, 1, 1, 2, 2, 3, 6]


def test_healthy_traffic_raises_nothing_and_collapse_raises_low_diversity():
    rng = np.random.default_rng(0)
    detector = Detector(DetectorConfig(reference_traces=150, false_alarm_arl=10_000))
    learning = [observe(rng, detector) for _ in range(150)]
    assert not any(learning)
    healthy = [a for _ in range(1500) for a in observe(rng, detector)]
    assert len(healthy) <= 3, healthy  # ~0.15 expected per kind at ARL 10k; near-one-hot heads included
    first = None
    for i in range(60):
        kinds = {a.kind for a in observe(rng, detector, collapse=0.9)}
        if "low_diversity" in kinds:
            first = i
            break
    assert first is not None and first < 20


def test_a_pinned_revision_is_judged_by_its_predecessor_from_its_first_trace():
    rng = np.random.default_rng(1)
    detector = Detector(DetectorConfig(reference_traces=100, pins={("m", "r2"): "r1"}))
    for _ in range(100):
        observe(rng, detector, revision="r1")
    raised = [a for _ in range(15) for a in observe(rng, detector, revision="r2", collapse=0.9)]
    assert any(a.kind == "low_diversity" and a.reference_revision == "r1" for a in raised)
    # Without the pin, r2 would learn its collapsed self as normal and stay silent.
    alone = Detector(DetectorConfig(reference_traces=100))
    assert not [a for _ in range(130) for a in observe(rng, alone, revision="r2", collapse=0.9)]


def test_reference_is_per_length_bucket():
    rng = np.random.default_rng(2)
    detector = Detector(DetectorConfig(reference_traces=50))
    for _ in range(50):
        observe(rng, detector, keys=64)
    assert detector.reference_for("m", "r1", 1, 64)[0] is not None
    assert detector.reference_for("m", "r1", 1, 1024)[0] is None  # longer sequences learn their own


def test_state_merges_across_instances():
    rng = np.random.default_rng(3)
    a, b = Detector(DetectorConfig(reference_traces=40)), Detector(DetectorConfig(reference_traces=40))
    for _ in range(30):
        observe(rng, a)
        observe(rng, b)
    merged = Detector(DetectorConfig(reference_traces=40))
    merged.merge_state(a.state_dict())
    merged.merge_state(b.state_dict())
    ref, _ = merged.reference_for("m", "r1", 1, 64)
    assert ref is not None and ref.count == 60
