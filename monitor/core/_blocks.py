"""Cache-sized passes over attention weights: the inner loop of :mod:`metrics`.

Every metric reduces a trace ``[H, R, K]`` row by row, and the similarity Gram
matrix sums over (row, key). Both decompose over blocks of rows, so a trace is
processed a few rows at a time (small traces several at a time), in scratch
buffers that stay in the CPU cache and are reused from block to block. Each block
is converted to float32 once and then visited by a handful of vectorised passes.

float16 is converted at the bit level (numpy's own float16 cast is a scalar loop,
about 8x slower): the 15 magnitude bits, shifted left by 13, are the float32 whose
exponent field is the float16's, so its value is exactly the float16's times 2⁻¹¹²;
one multiplication by 2¹¹² (a power of two: exact) restores it. A float16 subnormal
``m·2⁻²⁴`` becomes the float32 subnormal ``m·2⁻¹³⁶``, which the multiplication makes
normal again, and zero stays zero. Every step is exact, so the result equals
``astype(float32)``; it takes three passes (cast to 32 bits, shift, multiply). (A
process whose floating-point unit treats subnormal inputs as zero, which numpy never
asks for, would read float16 subnormals as 0; a test pins the exact result.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

F32 = np.float32
_UNBIAS = F32(2.0**112)  # float32's exponent bias (127) less float16's (15)
_TINY = F32(np.finfo(np.float32).tiny)
#: elements per block: 2**18 float32 values are 1 MiB, well inside L2.
BLOCK_ELEMENTS = 1 << 18
#: a row's Gram matrix goes through the general matrix product while heads² × keys
#: stays under this and heads under ``GENERAL_PRODUCT_HEADS``; beyond, through the
#: symmetric one: where the general product, copy included, measured faster
#: (``docs/performance.md``, the metrics core).
GENERAL_PRODUCT_MAX = 1 << 20
GENERAL_PRODUCT_HEADS = 32


@dataclass
class Scratch:
    """Reusable float32 buffers; grown on demand, never shrunk."""

    values: NDArray[np.float32] = field(default_factory=lambda: np.empty(0, F32))
    other: NDArray[np.float32] = field(default_factory=lambda: np.empty(0, F32))
    units: NDArray[np.float32] = field(default_factory=lambda: np.empty(0, F32))

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


def to_float32(
    src: NDArray[np.generic],
    out: NDArray[np.float32],
    valid: NDArray[np.generic] | None = None,
    spare: NDArray[np.float32] | None = None,
) -> NDArray[np.uint16] | None:
    """Write ``src`` (float16 or float32, finite, non-negative) into ``out`` as float32,
    with zeros where ``valid`` is False (or 0). ``spare`` (same size as ``out``) is scratch.

    For float16, returns the bit patterns it converted (masked; in ``spare`` when
    ``valid`` is given), which order as the values do; for float32, None."""
    if src.dtype == np.float32:
        if valid is None:
            np.copyto(out, src)
        else:
            np.multiply(src, valid, out=out)
        return None
    half = src.view(np.uint16) if valid is None else masked_bits(src, valid, spare)
    bits = out.view(np.uint32)
    np.copyto(bits, half, casting="unsafe")
    np.left_shift(bits, 13, out=bits)
    np.multiply(out, _UNBIAS, out=out)
    return half


def masked_bits(src: NDArray[np.generic], valid: NDArray[np.generic],
                spare: NDArray[np.float32] | None = None) -> NDArray[np.uint16]:
    """The bit patterns of float16 ``src`` with zeros where ``valid`` is False, in the
    first half of ``spare`` (shaped like ``src``, float32) when given."""
    room = np.empty(src.shape, F32) if spare is None else spare
    masked = room.view(np.uint16)[..., : src.shape[-1]]
    np.multiply(src.view(np.uint16), valid, out=masked)
    return masked


def half_bits_to_float32(bits: NDArray[np.uint16]) -> NDArray[np.float32]:
    """float32 values of (few) finite non-negative float16 bit patterns."""
    out = np.empty(bits.shape, F32)
    to_float32(bits.view(np.float16), out)
    return out


@dataclass
class BlockSums:
    """Per-row sums of one block ``[t, H, r]`` and its Gram contribution ``[t, H, H]``."""

    total: NDArray[np.float32]
    xlog2x: NDArray[np.float32]
    peak: NDArray[np.float32]
    first: NDArray[np.float32]
    gram: NDArray[np.float32]
    everything: NDArray[np.float32] | None = None  #: row sums over all keys, valid or not


def reduce_block(
    weights: NDArray[np.generic],
    valid: NDArray[np.generic] | None,
    scratch: Scratch,
    with_everything: bool = False,
) -> BlockSums:
    """Row sums of ``w``, ``w·log₂ w``, the row maximum and ``w[..., 0]`` over valid keys,
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
        to_float32(weights, w, None, o)
        everything = np.matmul(w, ones)
        np.multiply(w, _as_mask(valid, F32), out=w)
        half = None  # masking the bit patterns as well costs a pass more than the maximum below saves
    else:
        mask = None if valid is None else _as_mask(valid, np.uint16 if weights.dtype == np.float16 else F32)
        half = to_float32(weights, w, mask, o)
    total = np.matmul(w, ones)
    if with_everything and everything is None:
        everything = total
    # the row maximum on the masked float16 bit patterns when the conversion made them (half
    # the bytes; they order as the values), else on the masked float32 block
    peak = w.max(axis=-1) if half is None else half_bits_to_float32(half.max(axis=-1))
    first = w[..., 0].copy()
    # w·log₂ w with 0·log 0 = 0: adding the smallest normal float32 leaves every float16
    # value unchanged (they are all far larger) and makes log(0) finite; w = 0 then
    # multiplies it away. (numpy's float32 log2 takes about 0.7x the time of its log.)
    np.add(w, _TINY, out=o)
    np.log2(o, out=o)
    xlog2x = np.matmul(w[..., None, :], o[..., :, None])[..., 0, 0]
    # Gram matrix of sqrt(p) = sqrt(w) / sqrt(rowsum) over (row, key): one product per
    # row, scaled afterwards on [t, r, H, H] (far cheaper than scaling the block); rows
    # without mass count 0.
    with np.errstate(divide="ignore"):
        inv = np.where(total > 0, 1.0 / np.sqrt(total), 0.0).astype(F32)
    np.sqrt(w, out=o)
    rows = o.transpose(0, 2, 1, 3)  # [t, r, H, K]
    other = rows
    heads, keys = weights.shape[-3], weights.shape[-1]
    if heads <= GENERAL_PRODUCT_HEADS and heads * heads * keys < GENERAL_PRODUCT_MAX:
        # numpy hands ``a @ a.T`` to BLAS's symmetric product; on these matrices the
        # general product is faster, even counting the copy that makes the operands
        # two arrays (w is free by now)
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
    return BlockSums(total, xlog2x, peak, first, gram, everything)


def _as_mask(valid: NDArray[np.generic], dtype: type[np.generic]) -> NDArray[np.generic]:
    """``valid`` (``[t, H, r, K]``) as 0/1 of ``dtype`` when one ``[r, K]`` mask serves
    the whole block, as it does for a trace's heads: numpy casts a bool operand through
    a buffer on every pass. Otherwise the bool itself: a ``[t, 1, r, K]`` operand
    measured slower than it."""
    if valid.ndim != 4 or valid.strides[1] != 0 or (valid.shape[0] > 1 and valid.strides[0] != 0):
        return valid
    return valid[:1, :1].astype(dtype)
