"""The false-page replay (``benchmarks/false_pages.py``), small: its arithmetic against an
independent simulation, and one short capture and replay of a real checkpoint on real
text. The replay itself (100,000+ requests) is a script, not a test: docs/detection.md
has its figures."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.false_pages import LADDER, capture, exceedance, load, replay, report, siegmund_arl
from monitor.core.detect import DetectorConfig


def test_a_gaussian_cusums_maxima_are_uniform_under_the_exceedance_arithmetic():
    """Streams of unit-variance normal increments (the detector's model): the probability
    of each stream's maximum under the model is about uniform, so the replay's verdict on
    real streams means something."""
    rng = np.random.default_rng(7)
    streams, n, k = 300, 20_000, 0.5
    s = np.zeros(streams)
    maxima = np.zeros(streams)
    for _ in range(n):
        s = np.maximum(0.0, s + rng.standard_normal(streams) - k)
        np.maximum(maxima, s, out=maxima)
    p = exceedance(maxima, n, k)
    assert 0.03 <= float((p < 0.1).mean()) <= 0.18
    assert 0.38 <= float((p < 0.5).mean()) <= 0.62
    assert float(np.median(maxima)) == pytest.approx(float(np.log(2 * k * k * n / np.log(2)) - 1.166), abs=1.0)
    assert siegmund_arl(LADDER[0], k) < siegmund_arl(LADDER[-1], k)


@pytest.mark.models
def test_a_short_capture_of_real_text_replays_with_no_finding(tmp_path):
    paths = capture("python-docs", 230, seed=5, cache=tmp_path, log=lambda _: None)
    assert [p.exists() for p in paths] == [True]
    traces = load(tmp_path, "python-docs", 5)
    assert len(traces.requests) == 230 and all(len(r) == 6 for r in traces.requests)
    run = replay(traces, order_seed=0)
    assert run.judged == 30 and run.layer_traces == 180
    assert (run.findings, run.page_crossings) == (0, 0) and 0 < run.worst < 1
    lines: list[str] = []
    summary = report([run], DetectorConfig().shift / 2, 200, log=lines.append)
    assert summary["requests"] == 30 and any("crossings per stream-trace" in line for line in lines)


def test_the_threshold_corrected_for_the_references_estimation_error():
    """With no estimation error it is Siegmund's; with the errors of a 200-trace
    reference (each stream's mean off by ``b ~ N(0, 1/200)``, its variance by a factor
    ``v``, ``log v ~ N(0, 8/200)``) the 366 streams of all-MiniLM-L6-v2 at one request a
    second need 20.5 at ``k`` 0.75 instead of 13.7 (15.2 for the mean's error alone);
    larger budgets and smaller references need more, at most twice the uncorrected
    threshold."""
    from monitor.core.calibration import MAX_CORRECTION, corrected_threshold, false_alarm_rate, page_arl
    from monitor.core.detect import cusum_threshold

    arl, k = page_arl(366, 1.0, 0.05), 0.75
    assert corrected_threshold(arl, k, 10**12) == pytest.approx(cusum_threshold(arl, k), abs=0.01)
    corrected = corrected_threshold(arl, k, 200)
    assert corrected == pytest.approx(20.5, abs=0.1)
    assert corrected_threshold(arl, k, 200, variance_error=0.0) == pytest.approx(15.2, abs=0.1)
    assert false_alarm_rate(corrected, k, 200) == pytest.approx(1 / arl, rel=1e-3)
    assert corrected_threshold(page_arl(3864, 100.0, 0.05), k, 200) > corrected
    assert corrected_threshold(arl, k, 30) == pytest.approx(MAX_CORRECTION * cusum_threshold(arl, k), rel=1e-6)


def test_the_detector_pages_by_the_corrected_threshold():
    """The page threshold of a ready revision of MiniLM's shape (6 layers of 12 heads, 366
    streams) at a request a second allows for the estimation error of its
    ``REFERENCE_TRACES``-trace reference: 20.5 at 200 traces where Siegmund's unbiased
    model gives 13.7 (``k`` 0.75), and more for a smaller reference."""
    from monitor.core.calibration import corrected_threshold, page_arl
    from monitor.core.detect import Detector, DetectorConfig, Observation, cusum_threshold
    from monitor.core.metrics import head_metrics

    rng = np.random.default_rng(0)
    heads = tuple(f"head-{h}" for h in range(12))
    metrics = [head_metrics(rng.dirichlet(np.ones(16), size=(12, 4)).astype(np.float32)) for _ in range(8)]

    def page_threshold(reference_traces: int) -> float:
        detector = Detector(DetectorConfig(reference_traces=reference_traces))
        for layer in range(6):
            for i in range(reference_traces):
                detector.observe(Observation("m", "r", layer, 16, heads, metrics[i % len(metrics)], 1e9 + i))
        return detector.page_threshold(("m", "r", 0), "r")

    arl = page_arl(366, 1.0, 0.05)
    at_200 = page_threshold(200)
    assert at_200 == pytest.approx(corrected_threshold(arl, 0.75, 200), rel=1e-9)
    assert at_200 == pytest.approx(20.5, abs=0.1) and cusum_threshold(arl, 0.75) == pytest.approx(13.72, abs=0.01)
    at_50 = page_threshold(50)
    assert at_50 == pytest.approx(corrected_threshold(arl, 0.75, 50), rel=1e-9) and at_50 > at_200
