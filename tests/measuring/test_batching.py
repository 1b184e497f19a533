"""Traces of close key counts are measured together, padded, and get the metrics each
would get alone."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from monitor.core.metrics import head_metrics
from monitor.measuring import batching
from monitor.protocol.codec import valid_keys
from tests.factories import make_trace

FIELDS = ("entropy", "concentration", "sink_share", "similarity", "diversity", "effective_heads", "row_mass",
          "hidden_mass")


@dataclass(frozen=True)
class Weights:
    weights: np.ndarray
    valid: np.ndarray


def traced(seed: int, keys: int, rows: int = 4, dtype: str = "float16") -> Weights:
    header, weights = make_trace(seed, keys=keys, rows=rows, dtype=dtype)
    return Weights(weights, valid_keys(header))


def test_groups_join_close_key_counts_of_one_kind_and_keep_record_order():
    traces = [traced(0, 64), traced(1, 20), traced(2, 60), traced(3, 48), traced(4, 47), traced(5, 64, rows=3),
              traced(6, 63, dtype="float32"), traced(7, 21)]
    # 60 and 48 are within a quarter of 64, 47 is not; other rows or dtype: apart
    assert batching.groups(traces) == [[0, 2, 3], [1, 7], [4], [5], [6]]


def test_a_padded_batch_gives_each_trace_its_own_metrics():
    traces = [traced(i, keys) for i, keys in enumerate([40, 37, 33, 40, 31])]
    weights, valid = batching.batch(traces)
    assert weights.shape == (5, *traces[0].weights.shape[:2], 40) and valid.shape == (5, 1, 4, 40)
    assert not valid[2, 0, :, 33:].any() and (weights[2, :, :, 33:] == 0).all()
    whole = head_metrics(weights, valid, with_mass=True)
    for b, trace in enumerate(traces):
        alone = head_metrics(trace.weights, trace.valid, with_mass=True)
        for name in FIELDS:
            np.testing.assert_allclose(getattr(whole, name)[b], getattr(alone, name), rtol=1e-6, atol=1e-7,
                                       err_msg=name)


def test_a_batch_of_one_key_count_is_stacked_as_it_is():
    traces = [traced(i, 32) for i in range(3)]
    weights, valid = batching.batch(traces)
    assert np.array_equal(weights, np.stack([t.weights for t in traces]))
    assert np.array_equal(valid[:, 0], np.stack([t.valid for t in traces]))


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_the_padding_allowed_is_what_groups_use(monkeypatch, fraction):
    monkeypatch.setattr(batching, "PAD_FRACTION", fraction)
    traces = [traced(0, 64), traced(1, 40), traced(2, 31), traced(3, 64)]
    want = [[0, 3], [1], [2]] if fraction == 0.0 else [[0, 1, 3], [2]]
    assert batching.groups(traces) == want
