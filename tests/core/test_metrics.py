"""monitor.core.metrics against an independent float64 implementation, scipy, and
invariants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.spatial.distance import jensenshannon
from scipy.stats import entropy as scipy_entropy

import monitor.core.metrics as metrics
from monitor.core._blocks import to_float32
from monitor.core.mass import row_mass
from monitor.core.metrics import group_similarity, head_metrics, js_similarity
from tests.core.reference import reference_metrics

FIELDS = ("entropy", "concentration", "sink_share", "similarity", "diversity", "effective_heads")


def dirichlet(rng, h, r, k, alpha=0.3, dtype=np.float32):
    return rng.dirichlet(np.full(k, alpha), size=(h, r)).astype(dtype)


def causal(r, k):
    """Query rows at the last r positions of a k-token sequence."""
    positions = np.arange(k - r, k)[:, None]
    return np.arange(k)[None, :] <= positions


def padded(r, k, pad):
    valid = np.ones((r, k), bool)
    valid[:, k - pad :] = False
    return valid


def masked_softmax_like(rng, h, r, k, valid, dtype):
    w = dirichlet(rng, h, r, k, dtype=np.float64)
    w = np.where(valid, w, 0.0)
    with np.errstate(invalid="ignore"):
        w = w / w.sum(-1, keepdims=True)
    return np.nan_to_num(w).astype(dtype)


def assert_matches(got, want, atol):
    for name in FIELDS:
        np.testing.assert_allclose(getattr(got, name), want[name], atol=atol, rtol=0, equal_nan=True, err_msg=name)


@pytest.mark.parametrize("dtype,atol", [(np.float32, 2e-5), (np.float16, 2e-5)])
@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
def test_matches_the_float64_reference(dtype, atol, mask):
    rng = np.random.default_rng(7)
    h, r, k = 5, 6, 24
    valid = {"none": None, "causal": causal(r, k), "padding": padded(r, k, 5)}[mask]
    w = masked_softmax_like(rng, h, r, k, True if valid is None else valid, dtype)
    assert_matches(head_metrics(w, valid), reference_metrics(w, valid), atol)


def test_weight_on_invalid_keys_is_ignored_and_rows_renormalised():
    rng = np.random.default_rng(3)
    valid = causal(4, 10)
    w = dirichlet(rng, 3, 4, 10)  # mass everywhere, including on masked keys
    got = head_metrics(w, valid)
    assert_matches(got, reference_metrics(w, valid), 2e-5)
    clean = np.where(valid, w, 0)
    clean = (clean / clean.sum(-1, keepdims=True)).astype(np.float32)
    assert_matches(got, reference_metrics(clean, valid), 2e-5)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("with_mass", [False, True])
def test_concentration_takes_the_largest_weight_on_a_valid_key(dtype, with_mass):
    # the largest weight of every row sits on the last key, which only the last row sees
    valid = causal(4, 8)
    w = np.full((2, 4, 8), 0.05)
    w[..., -1] = 0.5
    got = head_metrics(w.astype(dtype), valid, with_mass=with_mass)
    assert_matches(got, reference_metrics(w.astype(dtype), valid), 2e-5)
    assert got.concentration == pytest.approx(np.full(2, (1 / 5 + 1 / 6 + 1 / 7 + 0.5 / 0.85) / 4), abs=1e-3)


def test_entropy_matches_scipy():
    rng = np.random.default_rng(11)
    w = dirichlet(rng, 3, 4, 50, dtype=np.float64).astype(np.float32)
    want = scipy_entropy(w.astype(np.float64), axis=-1).mean(axis=-1) / np.log(50)
    np.testing.assert_allclose(head_metrics(w).entropy, want, atol=1e-5)


def test_js_similarity_matches_scipy():
    rng = np.random.default_rng(5)
    valid = causal(3, 9)
    w = masked_softmax_like(rng, 4, 3, 9, valid, np.float32)
    got = js_similarity(w, valid)
    p = w.astype(np.float64)
    for a in range(4):
        for b in range(4):
            jsd = [jensenshannon(p[a, i][valid[i]], p[b, i][valid[i]], base=2) ** 2 for i in range(3)]
            assert got[a, b] == pytest.approx(1 - np.mean(jsd), abs=1e-6)


def test_rows_with_one_valid_key_count_for_concentration_not_entropy():
    w = np.zeros((2, 1, 4), np.float32)
    w[:, 0, 0] = 1.0
    valid = np.zeros((1, 4), bool)
    valid[0, 0] = True
    m = head_metrics(w, valid)
    assert np.isnan(m.entropy).all()
    np.testing.assert_allclose(m.concentration, 1.0)
    np.testing.assert_allclose(m.sink_share, 1.0)


def test_a_head_without_valid_rows_is_nan_and_left_out():
    rng = np.random.default_rng(2)
    w = dirichlet(rng, 3, 4, 8)
    valid = np.ones((3, 4, 8), bool)
    valid[1] = False  # head 1 sees nothing
    m = head_metrics(w, valid)
    assert np.isnan(m.entropy[1]) and np.isnan(m.concentration[1]) and np.isnan(m.sink_share[1])
    assert np.isnan(m.similarity[1]).all() and np.isnan(m.similarity[:, 1]).all()
    without = head_metrics(w[[0, 2]])
    assert m.diversity == pytest.approx(without.diversity, abs=1e-6)
    assert m.effective_heads == pytest.approx(without.effective_heads, abs=1e-6)


def test_single_head():
    rng = np.random.default_rng(4)
    m = head_metrics(dirichlet(rng, 1, 3, 6))
    assert m.similarity.shape == (1, 1) and m.similarity[0, 0] == 1.0
    assert m.effective_heads == 1.0
    assert np.isnan(m.diversity)  # no pair of heads: undefined, not 0


def test_permuting_heads_permutes_outputs():
    rng = np.random.default_rng(9)
    w = dirichlet(rng, 6, 4, 16)
    perm = rng.permutation(6)
    a, b = head_metrics(w), head_metrics(w[perm])
    for name in ("entropy", "concentration", "sink_share"):
        np.testing.assert_allclose(getattr(b, name), getattr(a, name)[perm], atol=1e-6)
    np.testing.assert_allclose(b.similarity, a.similarity[np.ix_(perm, perm)], atol=1e-6)
    assert b.diversity == pytest.approx(a.diversity, abs=1e-6)


def test_identical_heads():
    rng = np.random.default_rng(1)
    w = np.repeat(dirichlet(rng, 1, 4, 32), 8, axis=0)
    m = head_metrics(w)
    np.testing.assert_allclose(m.similarity, 1.0, atol=1e-6)
    assert m.diversity == pytest.approx(0.0, abs=1e-6)
    assert m.effective_heads == pytest.approx(1.0, abs=1e-5)


def test_heads_on_disjoint_one_hot_keys():
    h = 6
    w = np.zeros((h, 3, 10), np.float16)
    for head in range(h):
        w[head, :, head] = 1.0
    m = head_metrics(w)
    np.testing.assert_allclose(m.similarity, np.eye(h), atol=1e-7)
    assert m.effective_heads == pytest.approx(h)
    assert m.diversity == pytest.approx(1.0)
    np.testing.assert_allclose(m.entropy, 0.0, atol=1e-6)
    np.testing.assert_allclose(m.concentration, 1.0)


def test_batches_equal_single_traces_and_blocks_do_not_matter(monkeypatch):
    rng = np.random.default_rng(6)
    valid = causal(5, 40)
    batch = np.stack([masked_softmax_like(rng, 4, 5, 40, valid, np.float16) for _ in range(6)]).reshape(2, 3, 4, 5, 40)
    whole = head_metrics(batch, valid)
    monkeypatch.setattr(metrics, "BLOCK_ELEMENTS", 100)  # a few rows per block
    for idx in np.ndindex(2, 3):
        one = head_metrics(batch[idx], valid)
        for name in FIELDS:
            np.testing.assert_allclose(getattr(whole, name)[idx], getattr(one, name), atol=1e-6, err_msg=name)
    monkeypatch.setattr(metrics, "BLOCK_ELEMENTS", 10_000)  # several traces per block
    again = head_metrics(batch, valid)
    for name in FIELDS:
        np.testing.assert_allclose(getattr(again, name), getattr(whole, name), atol=1e-6, err_msg=name)


@pytest.mark.parametrize("largest", [0, 1 << 30])
def test_both_gram_products_give_the_reference_similarity(monkeypatch, largest):
    # 0: every row through BLAS's symmetric product; 2**30: through the general one
    import monitor.core._blocks as blocks

    monkeypatch.setattr(blocks, "GENERAL_PRODUCT_MAX", largest)
    rng = np.random.default_rng(11)
    valid = causal(6, 300)
    w = masked_softmax_like(rng, 7, 6, 300, valid, np.float32)
    got = head_metrics(w, valid)
    want = reference_metrics(w, valid)
    np.testing.assert_allclose(got.similarity, want["similarity"], atol=1e-5)
    np.testing.assert_array_equal(got.similarity, got.similarity.T)


def test_float16_conversion_is_exact_for_every_finite_non_negative_value():
    values = np.arange(0x7C00, dtype=np.uint16).view(np.float16)
    out = np.empty(values.shape, np.float32)
    to_float32(values, out)
    np.testing.assert_array_equal(out, values.astype(np.float32))


def test_group_similarity():
    s = np.array([[1.0, 0.9, 0.2, 0.1], [0.9, 1.0, 0.3, 0.2], [0.2, 0.3, 1.0, 0.8], [0.1, 0.2, 0.8, 1.0]])
    g = group_similarity(s, [0, 0, 1, 1])
    assert g.within == pytest.approx(0.85)
    assert g.across == pytest.approx(0.2)
    assert np.isnan(group_similarity(s, [0, 1, 2, 3]).within)  # MHA: no shared K/V
    assert np.isnan(group_similarity(s, [0, 0, 0, 0]).across)  # MQA: one group


def test_gqa_heads_sharing_keys_are_more_alike_within_groups():
    rng = np.random.default_rng(8)
    base = dirichlet(rng, 2, 4, 32, alpha=0.2)
    noise = dirichlet(rng, 4, 4, 32, alpha=0.2)
    w = (0.85 * np.repeat(base, 2, axis=0) + 0.15 * noise).astype(np.float32)
    g = group_similarity(head_metrics(w).similarity, [0, 0, 1, 1])
    assert g.within > g.across


@pytest.mark.parametrize(
    "weights,valid,message",
    [
        (np.ones((2, 2, 2), np.float64), None, "float16 or float32"),
        (np.ones((2, 2), np.float32), None, r"\[..., H, R, K\]"),
        (np.ones((2, 0, 2), np.float32), None, "empty"),
        (np.full((1, 1, 2), np.nan, np.float32), None, "finite"),
        (np.full((1, 1, 2), np.inf, np.float16), None, "finite"),
        (np.array([[[0.5, -0.5]]], np.float32), None, "non-negative"),
        (np.ones((1, 1, 2), np.float32), np.ones((1, 1, 2), np.int8), "bool"),
        (np.ones((1, 1, 2), np.float32), np.ones((3,), bool), "broadcast"),
    ],
)
def test_bad_input_gets_a_message_naming_the_parameter(weights, valid, message):
    with pytest.raises(ValueError, match=message):
        head_metrics(weights, valid)


def test_negative_zero_is_zero():
    w = np.array([[[0.5, 0.5, -0.0]]], np.float16)
    np.testing.assert_allclose(head_metrics(w).concentration, 0.5)


@st.composite
def traces(draw):
    h, r, k = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    alpha = draw(st.sampled_from([0.05, 0.5, 5.0]))
    w = rng.dirichlet(np.full(k, alpha), size=(h, r))
    zeros = rng.random((h, r, k)) < draw(st.sampled_from([0.0, 0.3]))
    w = np.where(zeros, 0.0, w).astype(draw(st.sampled_from([np.float16, np.float32])))
    valid = rng.random((h, r, k)) < 0.7 if draw(st.booleans()) else None
    return w, valid


@settings(max_examples=150, deadline=None)
@given(traces())
def test_property_matches_reference_and_stays_in_range(trace):
    w, valid = trace
    got = head_metrics(w, valid)
    assert_matches(got, reference_metrics(w, valid), 5e-5)
    h = w.shape[0]
    for name in ("entropy", "concentration", "sink_share", "similarity"):
        values = getattr(got, name)
        finite = values[np.isfinite(values)]
        assert ((finite >= 0) & (finite <= 1)).all(), name
    if np.isfinite(got.effective_heads):
        assert 1 - 1e-9 <= got.effective_heads <= h + 1e-9


@settings(max_examples=60, deadline=None)
@given(traces())
def test_row_masses_from_the_metrics_pass_equal_the_separate_check(trace):
    w, valid = trace
    if valid is None:
        valid = np.ones(w.shape, bool)
    m = head_metrics(w, valid, with_mass=True)
    shown, hidden = row_mass(w, valid)
    np.testing.assert_allclose(m.row_mass, shown, atol=1e-6)
    np.testing.assert_allclose(m.hidden_mass, hidden, atol=1e-6)
    assert head_metrics(w, valid).row_mass is None


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_hidden_mass_is_found_in_the_one_block_that_carries_it(dtype):
    # one row per block, and only the middle row puts weight on hidden keys: the
    # metrics pass must find it there and nowhere else, as the separate check does
    rng = np.random.default_rng(3)
    h, r, k = 2, 3, 1 << 17
    w = rng.random((h, r, k))
    valid = np.ones((r, k), bool)
    valid[:, k // 2 :] = False
    w[:, [0, 2], k // 2 :] = 0
    w = (w / w.sum(-1, keepdims=True)).astype(dtype)
    m = head_metrics(w, valid, with_mass=True)
    shown, hidden = row_mass(w, valid)
    assert hidden[:, 1].min() > 0.4 and hidden[:, [0, 2]].max() == 0
    np.testing.assert_allclose(m.hidden_mass, hidden, atol=1e-6)
    np.testing.assert_allclose(m.row_mass, shown, rtol=1e-5)
    peak = np.where(valid, w.astype(np.float64), 0).max(-1) / shown
    np.testing.assert_allclose(m.concentration, peak.mean(-1), rtol=1e-6)
