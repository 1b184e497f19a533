"""Mergeable running statistics (Chan et al. 1979 pairwise update of count, mean, M2).

State from two instances, or from before and after a restart, combines exactly: merging
the moments of two streams equals the moments of their concatenation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray


@dataclass
class Moments:
    """Count, mean and M2 (sum of squared deviations) of each coordinate of a vector."""

    count: NDArray[np.float64]
    mean: NDArray[np.float64]
    m2: NDArray[np.float64]

    @classmethod
    def empty(cls, size: int) -> Moments:
        return cls(np.zeros(size), np.zeros(size), np.zeros(size))

    def update(self, values: ArrayLike) -> None:
        """Add one observation per coordinate; NaN coordinates are skipped."""
        x = np.asarray(values, dtype=np.float64).reshape(self.mean.shape)
        seen = np.isfinite(x)
        n = self.count + seen
        delta = np.where(seen, x - self.mean, 0.0)
        self.mean = self.mean + np.divide(delta, n, out=np.zeros_like(delta), where=n > 0)
        self.m2 = self.m2 + delta * np.where(seen, x - self.mean, 0.0)
        self.count = n

    def merge(self, other: Moments) -> Moments:
        """The moments of both streams together (neither operand changes)."""
        n = self.count + other.count
        delta = other.mean - self.mean
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(n > 0, self.mean + delta * np.divide(other.count, n, where=n > 0,
                                                                 out=np.zeros_like(n)), 0.0)
            m2 = self.m2 + other.m2 + delta**2 * np.divide(self.count * other.count, n, where=n > 0,
                                                           out=np.zeros_like(n))
        return Moments(n, mean, m2)

    @property
    def variance(self) -> NDArray[np.float64]:
        """Sample variance (n − 1); NaN below two observations."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.count > 1, self.m2 / np.maximum(self.count - 1, 1), np.nan)

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count.tolist(), "mean": self.mean.tolist(), "m2": self.m2.tolist()}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Moments:
        return cls(*(np.asarray(doc[k], dtype=np.float64) for k in ("count", "mean", "m2")))


@dataclass
class MatrixMean:
    """Running sum and count of a matrix (e.g. the head similarity matrix of a layer)."""

    total: NDArray[np.float64]
    count: NDArray[np.float64] = field(default_factory=lambda: np.zeros(()))

    @classmethod
    def empty(cls, shape: tuple[int, ...]) -> MatrixMean:
        return cls(np.zeros(shape), np.zeros(shape))

    def update(self, matrix: ArrayLike) -> None:
        m = np.asarray(matrix, dtype=np.float64)
        seen = np.isfinite(m)
        self.total = self.total + np.where(seen, m, 0.0)
        self.count = self.count + seen

    def merge(self, other: MatrixMean) -> MatrixMean:
        return MatrixMean(self.total + other.total, self.count + other.count)

    @property
    def mean(self) -> NDArray[np.float64]:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.count > 0, self.total / np.maximum(self.count, 1), np.nan)

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total.tolist(), "count": self.count.tolist()}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> MatrixMean:
        return cls(np.asarray(doc["total"], dtype=np.float64), np.asarray(doc["count"], dtype=np.float64))
