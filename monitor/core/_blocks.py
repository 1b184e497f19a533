"""Cache-sized passes over attention weights: the inner loop of :mod:`metrics`.

Every metric reduces a trace ``[H, R, K]`` row by row, and the similarity Gram
matrix sums over (row, key). Both decompose over blocks of rows, so a trace is
processed a few rows at a time (small traces several at a time), in scratch
buffers that stay in the CPU cache and are reused from block to block. Each block
is converted to float32 once and then visited by a handful of vectorised passes.

float16 is converted at the bit level (numpy's own float16 cast is a scalar loop,
about 8x slower): the 15 magnitude bits are shifted into a float32 with the exponent
rebased by 112, which is exact for normal numbers and maps a subnormal ``m·2⁻²⁴`` to
``2⁻¹⁵ + m·2⁻²⁵``; adding ``min(v, 2⁻¹⁴) − 2⁻¹⁴`` undoes that exactly (Sterbenz) and
leaves normal numbers untouched. Every step is exact, so the result equals
``astype(float32)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

F32 = np.float32
_REBIAS = np.uint32(112 << 23)
_SUBNORMAL_EDGE = F32(2.0**-14)
_TINY = F32(np.finfo(np.float32).tiny)
#: elements per block: 2**18 float32 values are 1 MiB, well inside L2.
BLOCK_ELEMENTS = 1 << 18
#: largest heads × keys for which a row's Gram matrix goes through the general matrix
#: product (measured faster up to here, slower from 32 × 1024 on)
GENERAL_PRODUCT_MAX = 1 << 14


@dataclass
class Scratch:
    """Reusable float32 buffers; grown on demand, never shrunk."""

    values: NDArray[np.float32] = field(default_factory=lambda: np.empty(0, F32))
    other: NDArray[np.float32] = field(default_factory=lambda: np.empty(0, F32))
    units: NDArray[np.float32] = field(default_factory=lambda: np.empty(0, F32))
    edges: NDArray[np.float32] = field(default_factory=lambda: np.empty(0, F32))

    def take(self, n: int) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
        if self.values.size < n:
            self.values = np.empty(n, F32)
            self.other = np.empty(n, F32)
        return self.values[:n], self.other[:n]

    def ones(self, n: int) -> NDArray[np.float32]:
        """A vector of ``n`` ones (row sums as matrix products)."""
        if self.units.size < n:
            self.units = np.ones(n, F32)
        return self.units[:n]

    def edge(self, n: int) -> NDArray[np.float32]:
        """``n`` copies of 2⁻¹⁴ (numpy's minimum against an array is several times
        faster than against a scalar)."""
        if self.edges.size < n:
            self.edges = np.full(n, _SUBNORMAL_EDGE, F32)
        return self.edges[:n]


def to_float32(
    src: NDArray[np.generic],
    out: NDArray[np.float32],
    valid: NDArray[np.bool_] | None = None,
    spare: NDArray[np.float32] | None = None,
    edge: NDArray[np.float32] | None = None,
) -> None:
    """Write ``src`` (float16 or float32, finite, non-negative) into ``out`` as float32,
    with zeros where ``valid`` is False. ``spare`` (same size as ``out``) is scratch;
    ``edge``, if given, holds ``out.size`` copies of 2⁻¹⁴."""
    if src.dtype == np.float32:
        if valid is None:
            np.copyto(out, src)
        else:
            np.multiply(src, valid, out=out)
        return
    half = src.view(np.uint16)
    if valid is not None:
        masked = (np.empty(out.shape, F32) if spare is None else spare).view(np.uint16)[..., : src.shape[-1]]
        np.multiply(half, valid, out=masked)
        half = masked
    bits = out.view(np.uint32)
    np.copyto(bits, half, casting="unsafe")
    np.left_shift(bits, 13, out=bits)
    np.add(bits, _REBIAS, out=bits)
    # v' = v for normals; v' = 2^-15 + m 2^-25 for a subnormal m 2^-24 (and zero).
    # d = min(v', 2^-14) - 2^-14 is 0 for normals and v' - 2^-14 otherwise; v' + d = v.
    limit = _SUBNORMAL_EDGE if edge is None else edge.reshape(out.shape)
    d = np.minimum(out, limit, out=np.empty_like(out) if spare is None else spare)
    np.subtract(d, _SUBNORMAL_EDGE, out=d)
    np.add(out, d, out=out)


@dataclass
class BlockSums:
    """Per-row sums of one block ``[t, H, r]`` and its Gram contribution ``[t, H, H]``."""

    total: NDArray[np.float32]
    xlogx: NDArray[np.float32]
    peak: NDArray[np.float32]
    first: NDArray[np.float32]
    gram: NDArray[np.float32]
    everything: NDArray[np.float32] | None = None  #: row sums over all keys, valid or not


def reduce_block(
    weights: NDArray[np.generic],
    valid: NDArray[np.bool_] | None,
    scratch: Scratch,
    with_everything: bool = False,
) -> BlockSums:
    """Row sums of ``w``, ``w·log w``, the row maximum and ``w[..., 0]`` over valid keys,
    and the Gram matrix of ``sqrt(w / rowsum)`` over (row, key), for a block
    ``weights[t, H, r, K]`` with ``valid`` broadcast to the same shape (or None).
    ``with_everything`` also sums each row over all keys, before the mask.

    Row sums and dot products go through matrix products (a sum is a product with a
    vector of ones): BLAS reads the block once, at several times the speed of numpy's
    pairwise reductions; both accumulate in float32."""
    flat_w, flat_o = scratch.take(weights.size)
    w = flat_w.reshape(weights.shape)
    o = flat_o.reshape(weights.shape)
    ones = scratch.ones(weights.shape[-1])
    everything = None
    if with_everything and valid is not None:
        to_float32(weights, w, None, o, scratch.edge(w.size))
        everything = np.matmul(w, ones)
        np.multiply(w, valid, out=w)
    else:
        to_float32(weights, w, valid, o, scratch.edge(w.size))
    total = np.matmul(w, ones)
    if with_everything and everything is None:
        everything = total
    peak = w.max(axis=-1)
    first = w[..., 0].copy()
    # w·log w with 0·log 0 = 0: adding the smallest normal float32 leaves every float16
    # value unchanged (they are all far larger) and makes log(0) finite; w = 0 then
    # multiplies it away.
    np.add(w, _TINY, out=o)
    np.log(o, out=o)
    xlogx = np.matmul(w[..., None, :], o[..., :, None])[..., 0, 0]
    # Gram matrix of sqrt(p) = sqrt(w) / sqrt(rowsum) over (row, key): one product per
    # row, scaled afterwards on [t, r, H, H] (far cheaper than scaling the block); rows
    # without mass count 0.
    with np.errstate(divide="ignore"):
        inv = np.where(total > 0, 1.0 / np.sqrt(total), 0.0).astype(F32)
    np.sqrt(w, out=o)
    rows = o.transpose(0, 2, 1, 3)  # [t, r, H, K]
    other = rows
    if weights.shape[-3] * weights.shape[-1] <= GENERAL_PRODUCT_MAX:
        # numpy hands ``a @ a.T`` to BLAS's symmetric product; on small matrices the
        # general product is about twice as fast, even counting the copy that makes
        # the operands two arrays (w is free by now)
        np.copyto(w, o)
        other = w.transpose(0, 2, 1, 3)
    per_row = np.matmul(rows, other.transpose(0, 1, 3, 2))
    inv_rows = inv.transpose(0, 2, 1)
    per_row *= inv_rows[..., :, None]
    per_row *= inv_rows[..., None, :]
    gram = per_row.sum(axis=1)
    if other is not rows:  # the general product rounds g·h and h·g apart
        gram += gram.transpose(0, 2, 1)
        gram *= F32(0.5)
    return BlockSums(total, xlogx, peak, first, gram, everything)
