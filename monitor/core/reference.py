"""What is normal for a layer, as a function of sequence length.

Head metrics depend on how many keys a row sees: with four keys, heads have little room
to differ, and similarity falls as contexts grow. Real traffic is mostly short requests
with a long tail, so buckets of fixed length ranges either never fill or mix very
different levels. A :class:`LengthReference` instead keeps, per stream (layer diversity
and per-head metrics), mergeable sums in narrow bins of ``x = log2(key count)``
(:data:`BINS_PER_OCTAVE` per doubling) and answers, for any length, a *local linear fit*
over the nearest bins that together hold at least ``pool`` observations:

    μ(x) = a + b·x,   σ²(x) = RSS / (n − 2)

with ``a, b`` the least-squares fit of the pooled ``(x, y)`` and ``x`` clamped to the
pooled range (no extrapolation beyond the lengths seen). The bins pooled are chosen by
distance from the trace's bin, so a bin's fit is computed once and reused. Dense regions use narrow
windows, sparse regions wide ones; every length gets an answer once the reference holds
``pool`` traces, whatever their lengths. Sums are kept per stream (a stream may skip a
trace, e.g. entropy when no row sees two keys), so merging two references is adding
them: instances and restarts combine exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

BINS_PER_OCTAVE = 4
#: the sums kept per bin and stream: n, Σx, Σx², Σy, Σxy, Σy²
_FIELDS = ("n", "sx", "sxx", "sy", "sxy", "syy")


def length_x(key_count: int) -> float:
    """The length coordinate of a trace: log2 of its key count."""
    return math.log2(max(key_count, 1))


def length_bin(key_count: int) -> int:
    return math.floor(length_x(key_count) * BINS_PER_OCTAVE)


@dataclass(frozen=True)
class Fit:
    """The reference at one length: mean and deviation of every stream, and the number
    of observations behind each."""

    mean: NDArray[np.float64]
    sd: NDArray[np.float64]
    count: NDArray[np.float64]


@dataclass(frozen=True)
class _Local:
    """A bin's pooled fit, evaluated at any length of the bin."""

    intercept: NDArray[np.float64]
    slope: NDArray[np.float64]
    sd: NDArray[np.float64]
    count: NDArray[np.float64]
    lo: float
    hi: float

    def at(self, x: float) -> Fit:
        at = min(max(x, self.lo), self.hi)  # never extrapolate beyond the lengths pooled
        return Fit(np.where(self.count > 0, self.intercept + self.slope * at, np.nan), self.sd, self.count)


class LengthReference:
    def __init__(self, streams: int):
        if streams < 1:
            raise ValueError("a reference needs at least one stream")
        self.streams = streams
        self.bins: dict[int, NDArray[np.float64]] = {}  #: bin → [6, streams] sums
        self.traces = 0
        self._fits: dict[tuple[int, int], _Local] = {}  #: (bin, pool) → fit, until the sums change

    def update(self, key_count: int, values: ArrayLike) -> None:
        """Add one trace's value of every stream (NaN: the stream skips this trace)."""
        y = np.asarray(values, dtype=np.float64).reshape(self.streams)
        seen = np.isfinite(y)
        x = length_x(key_count)
        sums = self.bins.get(length_bin(key_count))
        if sums is None:
            sums = self.bins[length_bin(key_count)] = np.zeros((len(_FIELDS), self.streams))
        y0 = np.where(seen, y, 0.0)
        sums += np.stack([seen, seen * x, seen * x * x, y0, y0 * x, y0 * y0])
        self.traces += 1
        self._fits.clear()

    def merge(self, other: LengthReference) -> LengthReference:
        if other.streams != self.streams:
            raise ValueError(f"cannot merge a reference of {other.streams} streams into one of {self.streams}")
        merged = LengthReference(self.streams)
        for source in (self, other):
            for b, sums in source.bins.items():
                merged.bins[b] = merged.bins[b] + sums if b in merged.bins else sums.copy()
        merged.traces = self.traces + other.traces
        return merged

    def fit(self, key_count: int, pool: int) -> Fit:
        """The reference at ``key_count`` keys, pooled over the bins nearest to its bin
        that hold at least ``pool`` observations of every stream (or all of them)."""
        if not self.bins:
            nan = np.full(self.streams, np.nan)
            return Fit(nan, nan, np.zeros(self.streams))
        b = length_bin(key_count)
        local = self._fits.get((b, pool))
        if local is None:
            local = self._fits[(b, pool)] = self._local(b, pool)
        return local.at(length_x(key_count))

    def _local(self, center: int, pool: int) -> _Local:
        order = sorted(self.bins, key=lambda b: (abs(b - center), b))
        total = np.zeros((len(_FIELDS), self.streams))
        lo, hi = math.inf, -math.inf
        for b in order:
            total += self.bins[b]
            lo, hi = min(lo, b / BINS_PER_OCTAVE), max(hi, (b + 1) / BINS_PER_OCTAVE)
            if total[0].min() >= pool:
                break
        n, sx, sxx, sy, sxy, syy = total
        with np.errstate(invalid="ignore", divide="ignore"):
            spread = n * sxx - sx * sx
            sloped = (n >= 3) & (spread > 1e-9 * np.maximum(n * n, 1.0))
            slope = np.where(sloped, (n * sxy - sx * sy) / np.where(sloped, spread, 1.0), 0.0)
            intercept = (sy - slope * sx) / np.where(n > 0, n, 1.0)
            rss = syy - intercept * sy - slope * sxy
            dof = n - np.where(sloped, 2.0, 1.0)
            variance = np.where(dof > 0, np.maximum(rss, 0.0) / np.where(dof > 0, dof, 1.0), np.nan)
        return _Local(intercept, slope, np.sqrt(variance), n, lo, hi)

    def to_dict(self) -> dict[str, Any]:
        return {"streams": self.streams, "traces": self.traces,
                "bins": {str(b): sums.tolist() for b, sums in sorted(self.bins.items())}}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> LengthReference:
        ref = cls(int(doc["streams"]))
        ref.traces = int(doc["traces"])
        for b, sums in doc["bins"].items():
            array = np.asarray(sums, dtype=np.float64)
            if array.shape != (len(_FIELDS), ref.streams):
                raise ValueError(f"bin {b} holds sums of shape {array.shape}, expected {(len(_FIELDS), ref.streams)}")
            ref.bins[int(b)] = array
        return ref
