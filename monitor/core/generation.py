"""Metrics of a trace's decoding rows and of a learned attention sink.

``prompt_mass`` (the lookback ratio of Chuang et al. 2024, per head): for each row
generated after the prompt (position ``p ≥ prompt_length``), the share of its attention,
renormalised over its valid keys, that lands on the prompt's keys rather than on the
tokens generated so far; the mean over those rows. NaN for a head of a trace with no
decoding row (a prefill-only trace). A head that stops looking back at the prompt
while generating is what contextual-hallucination detectors watch.

``learned_sink_mass``: for a layer with a learned sink logit in its softmax (gpt-oss),
the mean over rows of the mass the sink absorbed (the row's keys get the rest). A sink
that stops absorbing, or absorbs everything, is a change worth a look.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

Array = NDArray[np.float64]


def prompt_mass(weights: ArrayLike, valid: ArrayLike, positions: ArrayLike, prompt_length: int) -> Array:
    """``[H]``: each head's mean share of attention on keys ``0 .. prompt_length - 1``
    over the rows at ``positions ≥ prompt_length``.

    Parameters
    ----------
    weights : ``[H, R, K]`` non-negative attention weights
    valid : ``[R, K]`` bool, the keys each row may see
    positions : ``[R]`` each row's key position
    prompt_length : keys before it are the prompt's
    """
    w = np.asarray(weights, dtype=np.float64)
    v = np.asarray(valid, dtype=bool)
    p = np.asarray(positions)
    if w.ndim != 3 or v.shape != w.shape[1:] or p.shape != (w.shape[1],):
        raise ValueError(f"weights [H, R, K], valid [R, K] and positions [R] disagree: {w.shape}, {v.shape}, "
                         f"{p.shape}")
    if prompt_length < 1:
        raise ValueError("prompt_length must be at least 1")
    decoding = p >= prompt_length
    if not decoding.any():
        return np.full(w.shape[0], np.nan)
    rows = w[:, decoding] * v[decoding]  # [H, r, K]
    total = rows.sum(axis=-1)
    on_prompt = rows[..., :prompt_length].sum(axis=-1)
    seen = total > 0  # a row with no weight on a valid key says nothing
    share = np.divide(on_prompt, total, out=np.zeros_like(total), where=seen)
    count = seen.sum(axis=-1)
    out: Array = np.divide(share.sum(axis=-1), count, out=np.full(w.shape[0], np.nan), where=count > 0)
    return out


def learned_sink_mass(sink: ArrayLike) -> Array:
    """``[H]``: each head's mean over rows of its learned sink's mass (``sink [H, R]``)."""
    s = np.asarray(sink, dtype=np.float64)
    if s.ndim != 2:
        raise ValueError(f"sink must be [H, R], got {s.shape}")
    out: Array = s.mean(axis=-1)
    return out
