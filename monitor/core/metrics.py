"""Per-head metrics of attention traces.

A trace holds, for one layer, the attention weights ``A[h, i, j]`` of head ``h``, sampled
query row ``i`` and key ``j``. Row ``i`` may see only a subset ``V_i`` of the keys
(causal or padding masks); ``n_i = |V_i|``. Rows are renormalised over their valid keys,
``p[h, i, j] = A[h, i, j] / Σ_{j∈V_i} A[h, i, j]``, and ``0·log 0 = 0``.

========================  =========================================================
entropy                   mean over rows with ``n_i ≥ 2`` of ``−Σ_j p log p / log n_i``
concentration             mean over rows of ``max_j p`` (the "confidence" of Voita et
                          al. 2019, *Analyzing Multi-Head Self-Attention*)
sink_share                mean over rows of ``p[h, i, 0]`` (0 when key 0 is not valid)
similarity ``S[h, g]``    mean over rows valid for both heads of the Bhattacharyya
                          coefficient ``Σ_j √(p_h p_g)``; ``S[h, h] = 1``
diversity                 ``1 − mean_{h≠g} S[h, g]``
effective_heads           ``H² / ‖S‖_F²``, the participation ratio, in ``[1, H]``
========================  =========================================================

A row counts when it has a valid key and positive mass on its valid keys. A head
without such rows gets NaN for its own metrics and is left out of diversity and
effective_heads; a pair of heads without a common row gets NaN similarity and is left
out of both. Nothing raises for these cases, and nothing is a silent 0.

The similarity is a Gram matrix of ``√p`` over (row, key): one matrix product per row.
:func:`js_similarity` offers the exact Jensen–Shannon similarity ``1 − JSD`` (in bits),
as used by Clark et al. 2019 (*What Does BERT Look At?*), for comparison; its cost grows
with ``H²`` and it is kept off the default path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from monitor.core._blocks import BLOCK_ELEMENTS, Scratch, reduce_block
from monitor.core.mass import value_fault

F64 = np.float64
_LN2 = float(np.log(2.0))
Array = NDArray[np.float64]


@dataclass(frozen=True)
class HeadMetrics:
    """Metrics of a batch of traces; leading dimensions ``...`` are the batch."""

    entropy: Array  #: ``[..., H]`` normalised entropy in [0, 1]
    concentration: Array  #: ``[..., H]`` mean row maximum in [1/n, 1]
    sink_share: Array  #: ``[..., H]`` mean weight on key 0 in [0, 1]
    similarity: Array  #: ``[..., H, H]`` Bhattacharyya similarity in [0, 1]
    diversity: Array  #: ``[...]`` 1 − mean off-diagonal similarity
    effective_heads: Array  #: ``[...]`` participation ratio in [1, H]
    #: ``[..., H, R]`` each row's mass on its valid keys, and on the keys its mask hides
    #: (only with ``with_mass=True``; for checking a trace without converting it twice)
    row_mass: Array | None = None
    hidden_mass: Array | None = None
    #: ``[..., H]`` (:mod:`monitor.core.generation`; NaN where the trace says nothing of
    #: them, set by the measurer): each head's share of decoding rows' attention on the
    #: prompt, and its learned sink's mean mass
    prompt_mass: Array | None = None
    learned_sink: Array | None = None


@dataclass(frozen=True)
class GroupSimilarity:
    """Mean off-diagonal similarity within and across KV groups (GQA/MQA)."""

    within: Array  #: ``[...]`` pairs of query heads that share K/V (NaN if none)
    across: Array  #: ``[...]`` pairs of query heads in different groups (NaN if none)


def head_metrics(weights: ArrayLike, valid: ArrayLike | None = None, *, scratch: Scratch | None = None,
                 with_mass: bool = False) -> HeadMetrics:
    """Entropy, concentration, sink share, similarity, diversity and effective heads.

    Parameters
    ----------
    weights : array of float16 or float32, shape ``[..., H, R, K]``
        Attention weights of ``H`` heads for ``R`` sampled query rows over ``K`` keys,
        as a softmax produced them; finite and non-negative. Leading dimensions are a
        batch of traces of the same shape.
    valid : bool array broadcastable to ``weights``, optional
        ``True`` where a key is visible to a row (``None``: every key is). Weight on
        invalid keys is ignored and rows are renormalised over the valid ones.
    scratch : Scratch, optional
        Reusable buffers; pass the same one to repeated calls to avoid reallocating.
    with_mass : bool
        Also return each row's mass on valid and on hidden keys (``row_mass``,
        ``hidden_mass``), measured in the same pass.

    Returns
    -------
    HeadMetrics
        float64 arrays; see the module documentation for the definitions.
    """
    w, v = _checked(weights, valid)
    *batch, h, r, k = w.shape
    flat = w.reshape(-1, h, r, k)
    vflat = None if v is None else np.broadcast_to(v, w.shape).reshape(-1, h, r, k)
    sums = _row_sums(flat, vflat, scratch or Scratch(), with_mass)
    n_valid = np.broadcast_to(_valid_count(v, k), w.shape[:-1]).reshape(-1, h, r)
    out = _finish(sums, n_valid.astype(F64))
    mass = None if sums.everything is None else sums.total.reshape(*batch, h, r)
    hidden = None if sums.everything is None else np.maximum(sums.everything - sums.total, 0.0).reshape(*batch, h, r)
    return HeadMetrics(
        entropy=out[0].reshape(*batch, h),
        concentration=out[1].reshape(*batch, h),
        sink_share=out[2].reshape(*batch, h),
        similarity=out[3].reshape(*batch, h, h),
        diversity=out[4].reshape(batch),
        effective_heads=out[5].reshape(batch),
        row_mass=mass,
        hidden_mass=hidden,
    )


def js_similarity(weights: ArrayLike, valid: ArrayLike | None = None) -> Array:
    """Exact Jensen–Shannon similarity ``1 − JSD(p_h, p_g)`` (log base 2), ``[..., H, H]``.

    ``JSD(P, Q) = H(M) − (H(P) + H(Q)) / 2`` with ``M = (P + Q) / 2``, averaged over rows
    valid for both heads (Clark et al. 2019). Float64 throughout; ``O(H² R K)``.
    Same parameters and conventions as :func:`head_metrics`.
    """
    w, v = _checked(weights, valid)
    p = w.astype(F64)
    if v is not None:
        p = p * v
    total = p.sum(axis=-1, keepdims=True)
    ok = total[..., 0] > 0  # [..., H, R]
    p = np.divide(p, total, out=np.zeros_like(p), where=total > 0)
    own = _entropy_bits(p)  # [..., H, R]
    h = p.shape[-3]
    sim = np.empty((*p.shape[:-3], h, h), F64)
    for a in range(h):
        m = 0.5 * (p[..., a : a + 1, :, :] + p)  # [..., H, R, K]
        jsd = _entropy_bits(m) - 0.5 * (own[..., a : a + 1, :] + own)
        both = ok[..., a : a + 1, :] & ok
        count = both.sum(axis=-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            sim[..., a, :] = np.where(count > 0, 1.0 - (jsd * both).sum(axis=-1) / count, np.nan)
    return np.clip(sim, 0.0, 1.0)


def group_similarity(similarity: ArrayLike, groups: Sequence[int]) -> GroupSimilarity:
    """Mean off-diagonal similarity within and across KV groups.

    Parameters
    ----------
    similarity : array ``[..., H, H]``
        From :func:`head_metrics` or :func:`js_similarity`.
    groups : sequence of H ints
        The KV group of each query head, in head order (GQA; MQA is one group).
    """
    s = np.asarray(similarity, dtype=F64)
    g = np.asarray(groups)
    if s.ndim < 2 or s.shape[-1] != s.shape[-2]:
        raise ValueError(f"similarity must have shape [..., H, H], got {s.shape}")
    if g.shape != (s.shape[-1],):
        raise ValueError(f"groups must give one KV group per head ({s.shape[-1]}), got shape {g.shape}")
    same = g[:, None] == g[None, :]
    off = ~np.eye(len(g), dtype=bool)
    return GroupSimilarity(within=_masked_mean(s, same & off), across=_masked_mean(s, ~same))


# --- internals -----------------------------------------------------------------------


def _checked(weights: ArrayLike, valid: ArrayLike | None) -> tuple[NDArray[np.generic], NDArray[np.bool_] | None]:
    w = np.asarray(weights)
    if w.dtype not in (np.float16, np.float32):
        raise ValueError(f"weights must be float16 or float32, got {w.dtype}")
    if w.ndim < 3:
        raise ValueError(f"weights must have shape [..., H, R, K], got {w.shape}")
    if min(w.shape) == 0:
        raise ValueError(f"weights must not be empty, got shape {w.shape}")
    w = np.ascontiguousarray(w)
    w = _finite_non_negative(w)
    if valid is None:
        return w, None
    v = np.asarray(valid)
    if v.dtype != np.bool_:
        raise ValueError(f"valid must be a bool array, got {v.dtype}")
    try:
        np.broadcast_shapes(v.shape, w.shape)
    except ValueError:
        raise ValueError(f"valid of shape {v.shape} does not broadcast to weights of shape {w.shape}") from None
    if np.broadcast_shapes(v.shape, w.shape) != w.shape:
        raise ValueError(f"valid of shape {v.shape} would enlarge weights of shape {w.shape}")
    return w, v


def _finite_non_negative(w: NDArray[np.generic]) -> NDArray[np.generic]:
    if w.dtype == np.float16 and int(w.view(np.uint16).max()) < 0x7C00:
        return w  # one integer pass: below +inf's bits, every value is finite and non-negative (no -0)
    fault = value_fault(w)
    if fault == "non_finite":
        raise ValueError("weights must be finite; found NaN or infinity")
    if fault == "negative":
        raise ValueError(f"weights must be non-negative; minimum is {float(w.min())}")
    if w.dtype == np.float16 and int(w.view(np.uint16).max()) >= 0x8000:
        positive: NDArray[np.generic] = np.abs(w)  # negative zeros: make them +0 for the bit-level cast
        return positive
    return w


def _valid_count(v: NDArray[np.bool_] | None, k: int) -> NDArray[np.int64]:
    if v is None:
        return np.array(k, dtype=np.int64)
    if v.ndim == 0:
        return np.array(k if v else 0, dtype=np.int64)
    if v.shape[-1] == 1:
        return v[..., 0].astype(np.int64) * k
    count: NDArray[np.int64] = v.sum(axis=-1, dtype=np.int64)
    return count


@dataclass
class _RowSums:
    total: Array
    xlog2x: Array
    peak: Array
    first: Array
    gram: Array
    everything: Array | None = None


def _row_sums(w: NDArray[np.generic], v: NDArray[np.bool_] | None, scratch: Scratch,
              with_mass: bool = False) -> _RowSums:
    t, h, r, k = w.shape
    per_trace = h * r * k
    rows = max(1, min(r, BLOCK_ELEMENTS // (h * k)))
    traces = max(1, BLOCK_ELEMENTS // per_trace) if rows == r else 1
    sums = _RowSums(
        total=np.empty((t, h, r), F64),
        xlog2x=np.empty((t, h, r), F64),
        peak=np.empty((t, h, r), F64),
        first=np.empty((t, h, r), F64),
        gram=np.zeros((t, h, h), F64),
        everything=np.empty((t, h, r), F64) if with_mass else None,
    )
    for t0 in range(0, t, traces):
        ts = slice(t0, min(t, t0 + traces))
        for r0 in range(0, r, rows):
            rs = slice(r0, min(r, r0 + rows))
            block = reduce_block(w[ts, :, rs], None if v is None else v[ts, :, rs], scratch, with_mass)
            sums.total[ts, :, rs] = block.total
            sums.xlog2x[ts, :, rs] = block.xlog2x
            sums.peak[ts, :, rs] = block.peak
            sums.first[ts, :, rs] = block.first
            sums.gram[ts] += block.gram
            if sums.everything is not None and block.everything is not None:
                sums.everything[ts, :, rs] = block.everything
    return sums


def _finish(s: _RowSums, n: Array) -> tuple[Array, ...]:
    live = s.total > 0
    rows = live & (n >= 1)
    spread = live & (n >= 2)
    if spread.all() and s.gram.shape[-1] > 1:
        return _finish_full(s, n)
    with np.errstate(divide="ignore", invalid="ignore"):
        safe_total = np.where(live, s.total, 1.0)
        entropy_nats = np.log(safe_total) - _LN2 * s.xlog2x / safe_total
        entropy_row = np.clip(entropy_nats / np.log(np.where(spread, n, 2.0)), 0.0, 1.0)
        entropy = _row_mean(entropy_row, spread)
        concentration = _row_mean(s.peak / safe_total, rows)
        sink = _row_mean(s.first / safe_total, rows)
        r = rows.astype(F64)
        common = np.matmul(r, r.transpose(0, 2, 1))  # rows valid for both heads
        sim = np.clip(np.where(common > 0, s.gram / common, np.nan), 0.0, 1.0)
    h = sim.shape[-1]
    eye = np.eye(h, dtype=bool)
    sim[:, eye] = np.where(np.diagonal(common, axis1=1, axis2=2) > 0, 1.0, np.nan)
    pairs = ~eye & np.isfinite(sim)
    diversity = 1.0 - _masked_mean(sim, pairs)
    finite = np.isfinite(sim)
    heads = finite[:, eye].sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        effective = np.where(heads > 0, heads.astype(F64) ** 2 / np.where(finite, sim**2, 0.0).sum(axis=(1, 2)), np.nan)
    return entropy, concentration, sink, sim, diversity, effective


def _finish_full(s: _RowSums, n: Array) -> tuple[Array, ...]:
    """:func:`_finish` when every row of every head has mass and two valid keys (the
    usual case): no NaN to route around, so plain means, in a few array operations."""
    _, h, r = s.total.shape
    inv = 1.0 / s.total
    entropy_row = (np.log(s.total) - _LN2 * s.xlog2x * inv) / np.log(n)
    entropy = np.clip(entropy_row, 0.0, 1.0).mean(axis=-1)
    concentration = (s.peak * inv).mean(axis=-1)
    sink = (s.first * inv).mean(axis=-1)
    sim = np.clip(s.gram / r, 0.0, 1.0)
    diagonal = np.arange(h)
    sim[:, diagonal, diagonal] = 1.0
    diversity = 1.0 - (sim.sum(axis=(1, 2)) - h) / (h * (h - 1))
    effective = h * h / np.square(sim).sum(axis=(1, 2))
    return entropy, concentration, sink, sim, diversity, effective


def _row_mean(values: Array, mask: NDArray[np.bool_]) -> Array:
    count = mask.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        total = np.where(mask, values, 0.0).sum(axis=-1)
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _masked_mean(s: Array, mask: NDArray[np.bool_]) -> Array:
    m = np.broadcast_to(mask, s.shape) & np.isfinite(s)
    count = m.sum(axis=(-2, -1))
    total = np.where(m, s, 0.0).sum(axis=(-2, -1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _entropy_bits(p: Array) -> Array:
    logs = np.log2(p, out=np.zeros_like(p), where=p > 0)
    result: Array = -(p * logs).sum(axis=-1)
    return result
