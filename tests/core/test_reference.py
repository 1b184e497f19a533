"""The length-aware reference against an independent least-squares fit, and its
invariants: merging is concatenating, no extrapolation, every length answered."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monitor.core.reference import LengthReference, fits, length_x


def filled(rng, lengths, slope=-0.05, noise=0.02):
    ref = LengthReference(2)
    points = []
    for n in lengths:
        x = length_x(n)
        y = 0.6 + slope * x + rng.normal(0, noise)
        ref.update(n, [y, np.nan if n % 7 == 0 else 2 * y])  # the second stream skips some traces
        points.append((x, y))
    return ref, np.array(points)


def test_pooling_everything_is_ordinary_least_squares():
    rng = np.random.default_rng(0)
    ref, points = filled(rng, rng.integers(4, 300, size=400))
    fit = ref.fit(40, pool=10_000)  # more than there is: every bin
    slope, intercept = np.polyfit(points[:, 0], points[:, 1], 1)
    assert fit.mean[0] == pytest.approx(intercept + slope * length_x(40), abs=1e-9)
    residual = points[:, 1] - (intercept + slope * points[:, 0])
    assert fit.sd[0] == pytest.approx(np.sqrt(residual @ residual / (len(points) - 2)), rel=1e-6)
    assert fit.count[0] == 400 and fit.count[1] < 400  # the second stream skipped every 7th length


def test_a_sparse_length_pools_its_neighbours_and_a_dense_one_stays_local():
    rng = np.random.default_rng(1)
    lengths = np.concatenate([rng.integers(6, 17, size=300), rng.integers(200, 257, size=10)])
    ref, _ = filled(rng, lengths, slope=-0.05)
    short, long = ref.fit(10, pool=40), ref.fit(230, pool=40)
    assert short.count[0] >= 40 and short.count[0] < 300  # a few bins of short requests
    assert long.count[0] >= 40  # the ten long ones plus the nearest short ones
    assert long.mean[0] == pytest.approx(0.6 - 0.05 * length_x(230), abs=0.03)


def test_no_extrapolation_beyond_the_lengths_pooled():
    rng = np.random.default_rng(2)
    ref, _ = filled(rng, rng.integers(8, 16, size=200), slope=-0.2)
    assert ref.fit(4096, pool=40).mean[0] == pytest.approx(ref.fit(15, pool=40).mean[0], abs=0.02)


def test_every_length_is_answered_once_pool_traces_exist():
    ref = LengthReference(1)
    for n in (5, 6, 7):
        ref.update(n, [0.5])
    assert np.isfinite(ref.fit(100_000, pool=3).mean[0])
    assert np.isnan(LengthReference(1).fit(10, pool=3).mean[0])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5000), st.floats(0, 1)), min_size=1, max_size=60), st.integers(0, 59))
def test_merging_two_references_equals_one_fed_both(observations, cut):
    whole, left, right = LengthReference(1), LengthReference(1), LengthReference(1)
    for i, (n, y) in enumerate(observations):
        whole.update(n, [y])
        (left if i < cut else right).update(n, [y])
    merged = LengthReference.from_dict(left.merge(right).to_dict())
    assert merged.traces == whole.traces and merged.bins.keys() == whole.bins.keys()
    for b in whole.bins:
        np.testing.assert_allclose(merged.bins[b], whole.bins[b], rtol=1e-12, atol=1e-12)


def test_fits_of_many_traces_are_exactly_each_traces_own_fit():
    """The detector standardises a chunk's traces together: row for row, ``fits`` must
    give what ``fit`` gives, across references, length bins and lengths beyond the data."""
    rng = np.random.default_rng(7)
    a, _ = filled(rng, rng.integers(6, 300, size=200))
    b, _ = filled(rng, rng.integers(20, 60, size=80), slope=0.1)
    pairs = [(ref, int(n)) for ref in (a, b, a) for n in (1, 7, 33, 34, 250, 4096)]
    mean, sd = fits([ref for ref, _ in pairs], [n for _, n in pairs], pool=40)
    for i, (ref, n) in enumerate(pairs):
        one = ref.fit(n, pool=40)
        assert np.array_equal(mean[i], one.mean, equal_nan=True) and np.array_equal(sd[i], one.sd, equal_nan=True)
