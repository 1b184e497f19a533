from __future__ import annotations

import numpy as np
import pytest

from monitor.core.identity import canonical_bytes, content_id, quantized


def test_key_order_does_not_matter_and_values_do():
    assert content_id("k", {"a": 1, "b": [1.5, "x"]}) == content_id("k", {"b": [1.5, "x"], "a": 1})
    assert content_id("k", {"a": 1}) != content_id("k", {"a": 2})
    assert content_id("k", {"a": 1}) != content_id("other", {"a": 1})


def test_arrays_are_hashed_by_dtype_shape_and_bytes():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert content_id("k", a) == content_id("k", a.astype(np.float64))  # floats hash as float64
    assert content_id("k", a) != content_id("k", a.reshape(3, 2))
    assert content_id("k", a) != content_id("k", a.T.copy())


def test_quantized_absorbs_last_bit_noise():
    x = np.array([0.1 + 0.2, 1e-300, -3.0])
    assert content_id("k", quantized(x)) == content_id("k", quantized(np.nextafter(x, 1)))
    assert content_id("k", quantized(x)) != content_id("k", quantized(x * 1.001))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), {1: "x"}, object(), np.array([np.nan])])
def test_values_without_a_canonical_form_are_refused(bad):
    with pytest.raises(ValueError):
        canonical_bytes(bad)


def test_canonical_bytes_are_compact_sorted_ascii():
    assert canonical_bytes({"b": 1, "a": [True, None, "é"]}) == b'{"a":[true,null,"\\u00e9"],"b":1}'
