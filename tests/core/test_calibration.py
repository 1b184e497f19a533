"""The thresholds' arithmetic (:mod:`monitor.core.calibration`): the false-alarm rate
averaged over a reference's error in each stream's mean and variance, and the threshold
that spends a budget with it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from monitor.core.calibration import (
    MAX_CORRECTION,
    VARIANCE_ERROR,
    corrected_threshold,
    cusum_run_length,
    false_alarm_rate,
    log_run_lengths,
    page_arl,
)
from monitor.core.detect import cusum_threshold


def test_the_run_lengths_elementwise_are_the_scalar_ones():
    h = np.array([0.5, 5.0, 20.0, 20.0, 20.0, 40.0, 3.0])
    drift = np.array([-0.5, -0.75, -0.5, 0.0, 0.3, -2.0, 1e-3])
    expected = [cusum_run_length(float(a), float(b)) for a, b in zip(h, drift, strict=True)]
    assert log_run_lengths(h, drift) == pytest.approx(expected, rel=1e-6)


def test_without_estimation_error_the_rate_is_siegmunds():
    for k in (0.5, 0.75):
        h = cusum_threshold(1e9, k)
        assert false_alarm_rate(h, k, 10**15) == pytest.approx(1e-9, rel=1e-4)
        assert corrected_threshold(1e9, k, 10**15) == pytest.approx(h, abs=1e-3)


def test_the_rate_is_the_average_over_the_references_errors_in_mean_and_variance():
    """Against a plain Monte Carlo average of Siegmund's rate over sampled errors: a mean
    off by ``b ~ N(0, 1/n)`` and a variance ``v`` times the reference's, ``log v ~ N(0,
    VARIANCE_ERROR / n)``; each error alone raises the rate, both together more."""
    rng = np.random.default_rng(3)
    n, k, h = 200, 0.75, 18.0
    b = rng.standard_normal(400_000) / math.sqrt(n)
    sd = np.exp(rng.standard_normal(b.size) * math.sqrt(VARIANCE_ERROR / n) / 2)
    sampled = float(np.mean([math.exp(-cusum_run_length(h / s, (m - k) / s)) for m, s in zip(b, sd, strict=True)]))
    assert false_alarm_rate(h, k, n) == pytest.approx(sampled, rel=0.05)
    exact = math.exp(-cusum_run_length(h, -k))
    mean_only = false_alarm_rate(h, k, n, variance_error=0.0)
    variance_only = float(np.mean([math.exp(-cusum_run_length(h / s, -k / s)) for s in sd]))
    assert exact < mean_only < false_alarm_rate(h, k, n) and exact < variance_only < false_alarm_rate(h, k, n)


def test_simulated_cusums_with_those_errors_alarm_at_the_averaged_rate():
    """Streams whose increments are normal with a mean and variance off as a small
    reference's are (n = 25, so the errors are large): their false alarms per observation
    follow the averaged rate, several times the rate of an exact reference."""
    rng = np.random.default_rng(11)
    n, k, h, streams, steps = 25, 0.75, 4.0, 2_000, 20_000
    b = rng.standard_normal(streams) / math.sqrt(n)
    sd = np.exp(rng.standard_normal(streams) * math.sqrt(VARIANCE_ERROR / n) / 2)
    s = np.zeros(streams)
    alarms = 0
    for _ in range(steps):
        s = np.maximum(0.0, s + b - k + sd * rng.standard_normal(streams))
        crossed = s > h
        alarms += int(crossed.sum())
        s[crossed] = 0.0
    observed = alarms / (streams * steps)
    averaged = false_alarm_rate(h, k, n)
    assert observed == pytest.approx(averaged, rel=0.35)
    assert observed > 3 * false_alarm_rate(h, k, 10**15)


def test_the_corrected_threshold_spends_the_budget_and_is_bounded():
    """All-MiniLM-L6-v2's 366 streams at a request a second with a 200-trace reference:
    the threshold whose averaged rate is the budget's, higher than either error alone
    asks for, never more than ``MAX_CORRECTION`` times Siegmund's; a smaller reference
    asks more."""
    arl = page_arl(366, 1.0, 0.05)
    k = 0.75
    h = corrected_threshold(arl, k, 200)
    assert false_alarm_rate(h, k, 200) == pytest.approx(1 / arl, rel=1e-3)
    assert h > corrected_threshold(arl, k, 200, variance_error=0.0) > cusum_threshold(arl, k)
    assert corrected_threshold(arl, k, 100) > h > corrected_threshold(arl, k, 800)
    assert corrected_threshold(arl, k, 10) == pytest.approx(MAX_CORRECTION * cusum_threshold(arl, k), rel=1e-6)
    with pytest.raises(ValueError, match="positive"):
        corrected_threshold(arl, 0.0, 200)
