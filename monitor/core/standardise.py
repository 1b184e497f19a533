"""A layer's streams, standardised against the references that judge them, many traces
at once.

A trace of a layer of ``H`` heads has ``1 + 6H`` values: the layer's diversity, then each
head's entropy, concentration, sink share, similarity to its nearest other head, learned
sink mass and prompt mass (:mod:`monitor.core.generation`; NaN for a trace without a
learned sink or decoding rows). The detector judges ``1 + 9H`` streams of them (sink
share, learned sink mass and prompt mass twice each, once per direction). Against
the reference at the trace's length each stream's value gets its reference mean, its
signed effect ``z = sign · (x − μ(L)) / σ(L)`` (``σ`` floored; the bad direction
positive) and the step it takes in its CUSUM, ``min(z, clip) − k``.

Traces of equal head count share every array operation here, whichever reference judges
each: a row's numbers are exactly those of the trace standardised alone (elementwise
arithmetic, in the same order), at a fraction of the cost per trace.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from monitor.core.metrics import HeadMetrics
from monitor.core.reference import LengthReference, fits

HEAD_METRICS = ("entropy", "concentration", "sink_share", "similarity", "learned_sink", "prompt_mass")


def head_similarity(similarity: NDArray[np.float64]) -> NDArray[np.float64]:
    """Each head's similarity to its nearest other head (NaN with fewer than two heads):
    a head that turns into a copy of another shows here even when its mean similarity
    to the rest hardly moves. ``similarity`` is ``[..., H, H]``; the result ``[..., H]``."""
    h = similarity.shape[-1]
    if h < 2:
        return np.full(similarity.shape[:-1], np.nan)
    others = np.where(np.isnan(similarity) | _diagonal(h), -np.inf, similarity)
    nearest: NDArray[np.float64] = others.max(axis=-1)
    nearest[nearest == -np.inf] = np.nan  # a head with no similarity this trace
    return nearest


def stream_values(metrics: Sequence[HeadMetrics]) -> NDArray[np.float64]:
    """``[N, 1 + 6H]``: each trace's value of every stream of its layer (layer diversity,
    then each head's entropy, concentration, sink share, similarity to its nearest other
    head, learned sink mass and prompt mass); the traces share their head count."""
    def optional(value: NDArray[np.float64] | None, like: NDArray[np.float64]) -> NDArray[np.float64]:
        return np.full(like.shape, np.nan) if value is None else value

    if len(metrics) == 1:
        o = metrics[0]
        return np.concatenate(([o.diversity], o.entropy, o.concentration, o.sink_share,
                               head_similarity(np.asarray(o.similarity)), optional(o.learned_sink, o.entropy),
                               optional(o.prompt_mass, o.entropy)))[None]
    return np.concatenate((np.array([[o.diversity] for o in metrics], dtype=np.float64),
                           np.stack([o.entropy for o in metrics]),
                           np.stack([o.concentration for o in metrics]),
                           np.stack([o.sink_share for o in metrics]),
                           head_similarity(np.stack([o.similarity for o in metrics])),
                           np.stack([optional(o.learned_sink, o.entropy) for o in metrics]),
                           np.stack([optional(o.prompt_mass, o.entropy) for o in metrics])), axis=1)


@functools.lru_cache(maxsize=64)
def _diagonal(h: int) -> NDArray[np.bool_]:
    eye = np.eye(h, dtype=bool)
    eye.flags.writeable = False
    return eye


@dataclass(frozen=True)
class Streams:
    """The streams of a layer of ``h`` heads, in judging order: layer diversity, each
    head's nearest-neighbour similarity, entropy, concentration, sink share up and down,
    learned sink mass up and down, prompt mass up and down; which value each reads, its
    bad direction, floor and threshold (the same for every trace of that many heads)."""

    block: dict[str, NDArray[np.intp]]  #: where each head metric's values sit in the value vector
    floors: NDArray[np.float64]  #: per value
    pick: NDArray[np.intp]
    sign: NDArray[np.float64]
    thresholds: NDArray[np.float64]

    @staticmethod
    def of(h: int, min_sd: Mapping[str, float], threshold: Callable[[int], float]) -> Streams:
        block = {m: np.arange(1 + i * h, 1 + (i + 1) * h) for i, m in enumerate(HEAD_METRICS)}
        floors = np.concatenate(([min_sd["diversity"]], *(np.full(h, min_sd[m]) for m in HEAD_METRICS)))
        two_sided = ("sink_share", "learned_sink", "prompt_mass")
        pick = np.concatenate(([0], block["similarity"], block["entropy"], block["concentration"],
                               *(block[m] for m in two_sided for _ in (1, 2))))
        sign = np.concatenate(([-1.0], np.ones(h), -np.ones(h), np.ones(h),
                               *(direction * np.ones(h) for _ in two_sided for direction in (1.0, -1.0))))
        thresholds = np.concatenate(([threshold(1)], np.full(3 * h, threshold(h)),
                                     np.full(2 * h * len(two_sided), threshold(2 * h))))
        return Streams(block, floors, pick, sign, thresholds)


@dataclass(frozen=True)
class Standardised:
    """Traces standardised together, one row each: the reference that judged each, and
    per stream in judging order its value ``x``, reference mean and effect ``z``, the
    step it takes in its CUSUM (0 for a stream the trace says nothing about: a NaN value
    or reference; the statistic, never negative, then waits where it is) and whether
    ``z ≥ min_effect``; per value, the reference's mean and floored deviation (for the
    evidence)."""

    references: list[LengthReference]
    x: NDArray[np.float64]
    mean: NDArray[np.float64]
    z: NDArray[np.float64]
    step: NDArray[np.float64]
    large: NDArray[np.bool_]
    value_mean: NDArray[np.float64]
    value_sd: NDArray[np.float64]


def standardise(streams: Streams, references: Sequence[LengthReference], key_counts: Sequence[int],
                values: NDArray[np.float64], *, pool: int, clip: float, k: float,
                min_effect: float) -> Standardised:
    """Row ``i``: ``values[i]`` (``1 + 4H`` values of a trace of ``key_counts[i]`` keys)
    against ``references[i]``, pooled over at least ``pool`` observations, each effect
    divided by the reference's calibrated ``scale`` when it has one. A NaN deviation (too
    few observations) takes the floor."""
    fit_mean, fit_sd = fits(references, key_counts, pool)
    sd = np.fmax(fit_sd, streams.floors)
    x, mean, dev = values[:, streams.pick], fit_mean[:, streams.pick], sd[:, streams.pick]
    if any(ref.scale is not None for ref in references):
        ones = np.ones(len(streams.pick))
        dev = dev * np.stack([ones if ref.scale is None else ref.scale for ref in references])
    seen = np.isfinite(x) & np.isfinite(mean)
    z = np.where(seen, streams.sign * (x - np.where(seen, mean, 0.0)) / dev, 0.0)
    step = np.where(seen, np.minimum(z, clip) - k, 0.0)
    return Standardised(list(references), x, mean, z, step, z >= min_effect, fit_mean, sd)
