"""Checks on the values of attention weights, before any metric is trusted.

:func:`value_fault` tests finiteness and sign on the bit patterns (an integer maximum
or two, no float conversion); :func:`row_mass` splits each row's mass into the part on
valid keys and the part on keys the mask hides, in the same cache-sized blocks as the
metrics.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import NDArray

from monitor.core._blocks import BLOCK_ELEMENTS, F32, Scratch, to_float32

Fault = Literal["non_finite", "negative"]


def value_fault(weights: NDArray[np.generic]) -> Fault | None:
    """``"non_finite"`` if any value is NaN or infinite, else ``"negative"`` if any is
    below zero, else None. Negative zero is not negative. float16 or float32 only."""
    w = np.ascontiguousarray(weights)
    if w.dtype == np.float16:
        suspicious = w.size > 0 and int(w.view(np.uint16).max()) >= 0x7C00
    elif w.dtype == np.float32:
        bits = w.view(np.int32)
        suspicious = w.size > 0 and (int(bits.min()) < 0 or int(bits.max()) >= 0x7F800000)
    else:
        raise ValueError(f"weights must be float16 or float32, got {w.dtype}")
    if not suspicious:
        return None
    if not np.isfinite(w).all():
        return "non_finite"
    if (w < 0).any():
        return "negative"
    return None  # only negative zeros tripped the bit test


def row_mass(
    weights: NDArray[np.generic], valid: NDArray[np.bool_], scratch: Scratch | None = None
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Per-row mass on valid keys and on hidden keys, each ``[H, R]``.

    ``weights [H, R, K]`` (finite, non-negative float16/float32), ``valid``
    broadcastable to it (True = visible).
    """
    w = np.ascontiguousarray(weights)
    if w.ndim != 3:
        raise ValueError(f"weights must have shape [H, R, K], got {w.shape}")
    h, r, k = w.shape
    v = np.broadcast_to(valid, w.shape)
    scratch = scratch or Scratch()
    on_valid = np.empty((h, r))
    on_hidden = np.empty((h, r))
    rows = max(1, min(r, BLOCK_ELEMENTS // max(1, h * k)))
    for r0 in range(0, r, rows):
        rs = slice(r0, min(r, r0 + rows))
        block = w[:, rs]
        flat, spare = scratch.take(block.size)
        f = flat.reshape(block.shape)
        to_float32(block, f, None, spare.reshape(block.shape))
        everything = f.sum(axis=-1, dtype=F32)
        np.multiply(f, v[:, rs], out=f)
        shown = f.sum(axis=-1, dtype=F32)
        on_valid[:, rs] = shown
        on_hidden[:, rs] = np.maximum(everything.astype(np.float64) - shown, 0.0)
    return on_valid, on_hidden
