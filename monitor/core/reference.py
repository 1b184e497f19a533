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

Beside the streams, a reference keeps the layer's mean head-similarity matrix (over all
lengths): not used to judge, but what the triage page shows a trace's matrix against.
While it learns it also keeps each trace's values (``samples``), from which, once it is
ready, the detector measures how far to trust its deviations (``scale``, per stream in
judging order: :mod:`monitor.core.calibration`); then the samples go.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
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

    @functools.cached_property
    def packed(self) -> NDArray[np.float64]:
        """``[4, streams]``: intercept, slope, sd and count, for :func:`fits`."""
        return np.stack([self.intercept, self.slope, self.sd, self.count])

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
        #: sum of the learnt traces' head-similarity matrices (NaN entries skipped), and counts
        self.matrix_sum: NDArray[np.float64] | None = None
        self.matrix_n: NDArray[np.float64] | None = None
        #: the learnt traces' (key count, values), kept until the reference is calibrated
        self.samples: list[tuple[int, NDArray[np.float64]]] = []
        #: per stream in judging order, what its effects are divided by (None: not calibrated)
        self.scale: NDArray[np.float64] | None = None

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

    def observed(self) -> NDArray[np.bool_]:
        """Per stream, whether any learnt trace had a value of it."""
        seen = np.zeros(self.streams, dtype=bool)
        for sums in self.bins.values():
            seen |= sums[0] > 0
        return seen

    def update_matrix(self, similarity: ArrayLike) -> None:
        """Add one trace's head-similarity matrix to the mean matrix."""
        m = np.asarray(similarity, dtype=np.float64)
        if self.matrix_sum is None or self.matrix_n is None or self.matrix_sum.shape != m.shape:
            self.matrix_sum, self.matrix_n = np.zeros_like(m), np.zeros_like(m)
        seen = np.isfinite(m)
        self.matrix_sum += np.where(seen, m, 0.0)
        self.matrix_n += seen

    def mean_matrix(self) -> NDArray[np.float64] | None:
        """The learnt traces' mean head-similarity matrix (None before any)."""
        if self.matrix_sum is None or self.matrix_n is None:
            return None
        with np.errstate(invalid="ignore", divide="ignore"):
            mean: NDArray[np.float64] = np.where(self.matrix_n > 0, self.matrix_sum / self.matrix_n, np.nan)
        return mean

    def merge(self, other: LengthReference) -> LengthReference:
        if other.streams != self.streams:
            raise ValueError(f"cannot merge a reference of {other.streams} streams into one of {self.streams}")
        merged = LengthReference(self.streams)
        for source in (self, other):
            for b, sums in source.bins.items():
                merged.bins[b] = merged.bins[b] + sums if b in merged.bins else sums.copy()
        merged.traces = self.traces + other.traces
        merged.samples = [*self.samples, *other.samples]
        scales = [r.scale for r in (self, other) if r.scale is not None]
        merged.scale = np.maximum.reduce(scales) if scales else None
        for source in (self, other):
            total, n = source.matrix_sum, source.matrix_n
            if total is None or n is None:
                continue
            if merged.matrix_sum is None or merged.matrix_n is None or merged.matrix_sum.shape != total.shape:
                merged.matrix_sum, merged.matrix_n = total.copy(), n.copy()
            else:
                merged.matrix_sum += total
                merged.matrix_n += n
        return merged

    def fit(self, key_count: int, pool: int) -> Fit:
        """The reference at ``key_count`` keys, pooled over the bins nearest to its bin
        that hold at least ``pool`` observations of every stream (or all of them)."""
        if not self.bins:
            nan = np.full(self.streams, np.nan)
            return Fit(nan, nan, np.zeros(self.streams))
        return self._pooled(length_bin(key_count), pool).at(length_x(key_count))

    def _pooled(self, center: int, pool: int) -> _Local:
        local = self._fits.get((center, pool))
        if local is None:
            local = self._fits[(center, pool)] = self._local(center, pool)
        return local

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
        doc: dict[str, Any] = {"streams": self.streams, "traces": self.traces,
                               "bins": {str(b): sums.tolist() for b, sums in sorted(self.bins.items())}}
        if self.matrix_sum is not None and self.matrix_n is not None:
            doc["matrix"] = {"sum": self.matrix_sum.tolist(), "n": self.matrix_n.tolist()}
        if self.samples:
            doc["samples"] = [[k, [x if math.isfinite(x) else None for x in v.tolist()]] for k, v in self.samples]
        if self.scale is not None:
            doc["scale"] = self.scale.tolist()
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> LengthReference:
        ref = cls(int(doc["streams"]))
        ref.traces = int(doc["traces"])
        for b, sums in doc["bins"].items():
            array = np.asarray(sums, dtype=np.float64)
            if array.shape != (len(_FIELDS), ref.streams):
                raise ValueError(f"bin {b} holds sums of shape {array.shape}, expected {(len(_FIELDS), ref.streams)}")
            ref.bins[int(b)] = array
        matrix = doc.get("matrix")  # absent in states saved before the triage page
        if matrix is not None:
            total, n = np.asarray(matrix["sum"], dtype=np.float64), np.asarray(matrix["n"], dtype=np.float64)
            if total.shape != n.shape or total.ndim != 2 or total.shape[0] != total.shape[1]:
                raise ValueError(f"mean matrix of shape {total.shape} and counts {n.shape}: not square and alike")
            ref.matrix_sum, ref.matrix_n = total, n
        for k, values in doc.get("samples", []):
            sample = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
            if sample.shape != (ref.streams,):
                raise ValueError(f"a sample holds {sample.shape} values, expected {ref.streams}")
            ref.samples.append((int(k), sample))
        if "scale" in doc:
            ref.scale = np.asarray(doc["scale"], dtype=np.float64)
        return ref


def fits(references: Sequence[LengthReference], key_counts: Sequence[int],
         pool: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Mean and deviation ``[len(key_counts), streams]``: row ``i`` holds exactly what
    ``references[i].fit(key_counts[i], pool)`` gives (the references share their number
    of streams, and have learnt something), at a fraction of the cost per trace."""
    fitted: dict[int, int] = {}  #: id of a pooled fit -> its place in ``distinct``
    distinct: list[_Local] = []
    index, at = [], []
    for ref, key_count in zip(references, key_counts, strict=True):
        x = length_x(key_count)
        local = ref._pooled(math.floor(x * BINS_PER_OCTAVE), pool)  # its length bin
        index.append(fitted.setdefault(id(local), len(distinct)))
        if index[-1] == len(distinct):
            distinct.append(local)
        at.append(min(max(x, local.lo), local.hi))
    if not distinct:
        return np.empty((0, 0)), np.empty((0, 0))
    if len(distinct) == 1:  # one reference, one length bin: the usual chunk of a layer
        packed = np.broadcast_to(distinct[0].packed, (len(index), *distinct[0].packed.shape))
    else:
        packed = np.stack([local.packed for local in distinct])[index]  # [N, 4, streams]
    mean = np.where(packed[:, 3] > 0, packed[:, 0] + packed[:, 1] * np.array(at)[:, None], np.nan)
    return mean, packed[:, 2]
