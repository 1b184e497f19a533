from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from monitor.core.online import MatrixMean, Moments

floats = st.floats(-1e3, 1e3, allow_nan=False)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(floats, min_size=3, max_size=3), min_size=1, max_size=40))
def test_streaming_equals_batch_after_every_update(rows):
    m = Moments.empty(3)
    for i, row in enumerate(rows):
        m.update(row)
        seen = np.array(rows[: i + 1])
        np.testing.assert_allclose(m.count, i + 1)
        np.testing.assert_allclose(m.mean, seen.mean(axis=0), rtol=1e-9, atol=1e-7)
        if i:
            np.testing.assert_allclose(m.variance, seen.var(axis=0, ddof=1), rtol=1e-7, atol=1e-6)


@settings(max_examples=80, deadline=None)
@given(st.lists(floats, min_size=0, max_size=30), st.lists(floats, min_size=0, max_size=30))
def test_merge_equals_the_concatenated_stream(a, b):
    left, right, both = Moments.empty(1), Moments.empty(1), Moments.empty(1)
    for x in a:
        left.update([x])
        both.update([x])
    for x in b:
        right.update([x])
        both.update([x])
    merged = left.merge(right)
    np.testing.assert_allclose(merged.count, both.count)
    np.testing.assert_allclose(merged.mean, both.mean, rtol=1e-9, atol=1e-7)
    np.testing.assert_allclose(merged.m2, both.m2, rtol=1e-7, atol=1e-5)
    assert Moments.from_dict(merged.to_dict()).to_dict() == merged.to_dict()


def test_nan_coordinates_are_skipped():
    m = Moments.empty(2)
    m.update([1.0, np.nan])
    m.update([3.0, 5.0])
    np.testing.assert_allclose(m.count, [2, 1])
    np.testing.assert_allclose(m.mean, [2, 5])


def test_matrix_mean():
    a = MatrixMean.empty((2, 2))
    a.update([[1, 0.5], [0.5, np.nan]])
    b = MatrixMean.empty((2, 2))
    b.update([[1, 0.7], [0.7, 1]])
    np.testing.assert_allclose(a.merge(b).mean, [[1, 0.6], [0.6, 1]])
