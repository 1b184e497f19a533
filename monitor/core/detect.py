"""Anomaly detection against a learnt reference, with a calibrated sequential test.

Reference
    For every (model, revision, layer, sequence-length bucket) the detector learns,
    from the first ``reference_traces`` traces it sees, the mean and variance of layer
    diversity and of each head's entropy, concentration and sink share (mergeable
    :class:`~monitor.core.online.Moments`), and the mean similarity matrix. A revision
    can instead be *pinned* to another revision's reference, to catch a regression at
    deploy. Sequence-length buckets (powers of 4 of the key count) exist because head
    similarity depends on length: short contexts leave heads fewer keys to differ on.

Per-head references mean there is no global threshold: a near one-hot head, or one
that parks most of its weight on the first token, is judged against its own normal.

Decision
    Each observation is standardised against the reference, ``z = (x − μ) / σ`` with
    ``σ`` floored (``min_sd``) so constant heads do not make noise look huge, and signed
    so that the bad direction is positive (diversity and entropy down, concentration
    up, sink share either way), and clipped at ``clip`` (3 by default) so that no single
    heavy-tailed outlier decides alone. A one-sided CUSUM ``S ← max(0, S + z − k)`` with
    ``k = shift / 2`` accumulates evidence; an anomaly is raised when ``S > h`` *and*
    the trace's own effect size ``z ≥ min_effect``, then ``S`` restarts at 0.

Calibration
    ``h`` is chosen so that the in-control average run length (expected traces
    between false alarms) of one (layer, kind) equals ``false_alarm_arl``, using
    Siegmund's approximation for a CUSUM of unit-variance normal increments,
    ``ARL₀ ≈ (e^{2kb} − 2kb − 1) / (2k²)`` with ``b = h + 1.166``. Head kinds have one
    stream per head, each calibrated to ``H · false_alarm_arl`` (and a two-sided sink
    test to twice that per side), so the rate per (layer, kind) stays at the target.
    The effect-size gate only removes alarms, so the realised rate is at most that.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from monitor.core.online import MatrixMean, Moments

KINDS = ("low_diversity", "entropy_collapse", "concentration_spike", "sink_shift")
HEAD_METRICS = ("entropy", "concentration", "sink_share")
LayerKey = tuple[str, str, int, int]  # model, revision, layer, length bucket


@dataclass(frozen=True)
class DetectorConfig:
    reference_traces: int = 200
    false_alarm_arl: float = 10_000.0
    shift: float = 1.0
    min_effect: float = 1.0
    #: standardised observations are clipped to ±clip before they enter the CUSUM, so one
    #: heavy-tailed outlier cannot cross the threshold alone (real head metrics are not normal)
    clip: float = 3.0
    min_sd: Mapping[str, float] = field(default_factory=lambda: {
        "diversity": 0.01, "entropy": 0.02, "concentration": 0.02, "sink_share": 0.02})
    #: (model, revision) -> the revision whose reference judges it
    pins: Mapping[tuple[str, str], str] = field(default_factory=dict)


@dataclass(frozen=True)
class Observation:
    """One trace's metrics, as the detector sees them."""

    model: str
    revision: str
    layer: int
    key_count: int
    heads: tuple[str, ...]
    entropy: NDArray[np.float64]
    concentration: NDArray[np.float64]
    sink_share: NDArray[np.float64]
    similarity: NDArray[np.float64]
    diversity: float


@dataclass(frozen=True)
class Anomaly:
    kind: str
    layer: int
    heads: tuple[str, ...]
    value: float  #: the observed value (head kinds: that head's)
    reference: float  #: the reference mean it is judged against
    effect: float  #: standardised effect size of this trace, bad direction positive
    score: float  #: the CUSUM statistic that crossed the threshold
    reference_revision: str


def length_bucket(key_count: int) -> int:
    """Power-of-4 bucket of the sequence length: 0 for 1–3 keys, 1 for 4–15, …"""
    return max(0, int(math.log(max(key_count, 1), 4)))


@functools.lru_cache(maxsize=256)
def cusum_threshold(arl: float, k: float) -> float:
    """``h`` with Siegmund's in-control ARL of a one-sided CUSUM equal to ``arl``."""
    if arl <= 1 or k <= 0:
        raise ValueError("arl must exceed 1 and k must be positive")

    def run_length(h: float) -> float:
        a = 2 * k * (h + 1.166)
        return (math.exp(a) - a - 1) / (2 * k * k)

    lo, hi = 0.0, 1.0
    while run_length(hi) < arl:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if run_length(mid) < arl else (lo, mid)
    return hi


@dataclass(frozen=True)
class _Plan:
    """The streams of a layer's CUSUM, as vectors over [diversity, H entropy,
    H concentration, H sink share up, H sink share down]."""

    mean: NDArray[np.float64]
    sd: NDArray[np.float64]
    sign: NDArray[np.float64]
    counted: NDArray[np.bool_]
    threshold: NDArray[np.float64]
    kinds: tuple[str, ...]  #: kind of each block of H head streams


@dataclass
class Reference:
    heads: int
    diversity: Moments = field(init=False)
    per_head: dict[str, Moments] = field(init=False)
    similarity: MatrixMean = field(init=False)
    plan: _Plan | None = field(init=False, default=None, repr=False)  #: cached by the detector, reset by update

    def __post_init__(self) -> None:
        self.diversity = Moments.empty(1)
        self.per_head = {m: Moments.empty(self.heads) for m in HEAD_METRICS}
        self.similarity = MatrixMean.empty((self.heads, self.heads))

    @property
    def count(self) -> int:
        return int(self.diversity.count[0])

    def update(self, obs: Observation) -> None:
        self.plan = None
        self.diversity.update([obs.diversity])
        for m in HEAD_METRICS:
            self.per_head[m].update(getattr(obs, m))
        self.similarity.update(obs.similarity)

    def merge(self, other: Reference) -> Reference:
        merged = Reference(self.heads)
        merged.diversity = self.diversity.merge(other.diversity)
        merged.per_head = {m: self.per_head[m].merge(other.per_head[m]) for m in HEAD_METRICS}
        merged.similarity = self.similarity.merge(other.similarity)
        return merged

    def to_dict(self) -> dict[str, Any]:
        return {"heads": self.heads, "diversity": self.diversity.to_dict(),
                "per_head": {m: v.to_dict() for m, v in self.per_head.items()},
                "similarity": self.similarity.to_dict()}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Reference:
        ref = cls(int(doc["heads"]))
        ref.diversity = Moments.from_dict(doc["diversity"])
        ref.per_head = {m: Moments.from_dict(doc["per_head"][m]) for m in HEAD_METRICS}
        ref.similarity = MatrixMean.from_dict(doc["similarity"])
        return ref


class Detector:
    """Learns references and judges observations; see the module documentation."""

    def __init__(self, config: DetectorConfig | None = None):
        self.config = config or DetectorConfig()
        self.references: dict[LayerKey, Reference] = {}
        self._cusum: dict[LayerKey, NDArray[np.float64]] = {}  #: CUSUM of every stream of a layer
        self._k = self.config.shift / 2

    def _threshold(self, streams: int) -> float:
        return cusum_threshold(self.config.false_alarm_arl * streams, self._k)

    def reference_for(self, model: str, revision: str, layer: int, key_count: int) -> tuple[Reference | None, str]:
        """The ready reference that judges this layer, and the revision it belongs to."""
        ref_revision = self.config.pins.get((model, revision), revision)
        ref = self.references.get((model, ref_revision, layer, length_bucket(key_count)))
        ready = ref is not None and ref.count >= self.config.reference_traces
        return (ref if ready else None), ref_revision

    def observe(self, obs: Observation) -> list[Anomaly]:
        """Learn from ``obs`` while its own reference is young; judge it once the
        reference that judges it (its own or the pinned one) is ready."""
        key = (obs.model, obs.revision, obs.layer, length_bucket(obs.key_count))
        own = self.references.get(key)
        if own is None or own.heads != len(obs.heads):
            own = self.references[key] = Reference(len(obs.heads))
        judge, ref_revision = self.reference_for(obs.model, obs.revision, obs.layer, obs.key_count)
        if own.count < self.config.reference_traces:
            own.update(obs)
            if judge is own or judge is None:
                return []
        if judge is None or judge.heads != len(obs.heads):
            return []
        return self._judge(key, judge, obs, ref_revision)

    def _judge(self, key: LayerKey, ref: Reference, obs: Observation, ref_revision: str) -> list[Anomaly]:
        """Every stream of the layer in one vector: layer diversity, then per head
        entropy, concentration, sink share up and sink share down."""
        plan = self._plan(ref)
        x = np.concatenate(([obs.diversity], obs.entropy, obs.concentration, obs.sink_share, obs.sink_share))
        if x.shape != plan.mean.shape:
            return []
        seen = np.isfinite(x)
        z = np.where(seen & plan.counted, plan.sign * (x - plan.mean) / plan.sd, 0.0)
        old = self._cusum.get(key)
        if old is None or old.shape != z.shape:
            old = np.zeros_like(z)
        s = np.maximum(0.0, old + np.minimum(z, self.config.clip) - self._k)
        if not seen[0]:  # no diversity this trace (no two live heads): its stream waits
            s[0] = old[0]
        hits = np.flatnonzero((s > plan.threshold) & (z >= self.config.min_effect))
        scores = s[hits].tolist()
        s[hits] = 0.0
        self._cusum[key] = s
        found = []
        h = len(obs.heads)
        for i, score in zip(hits.tolist(), scores, strict=True):
            if i == 0:
                found.append(Anomaly("low_diversity", obs.layer, self._converging_heads(ref, obs), obs.diversity,
                                     float(plan.mean[0]), float(z[0]), score, ref_revision))
            else:
                head = (i - 1) % h
                found.append(Anomaly(plan.kinds[(i - 1) // h], obs.layer, (obs.heads[head],), float(x[i]),
                                     float(plan.mean[i]), float(z[i]), score, ref_revision))
        return found

    def _plan(self, ref: Reference) -> _Plan:
        """Means, floored deviations, signs and thresholds of every stream of a ready
        reference (it no longer changes, so this is computed once)."""
        if ref.plan is not None:
            return ref.plan
        floors, h = self.config.min_sd, ref.heads
        means, sds, signs, counted, thresholds = [], [], [], [], []
        div = ref.diversity
        means.append(div.mean)
        sds.append(np.maximum(np.sqrt(np.nan_to_num(div.variance, nan=0.0)), floors["diversity"]))
        signs.append(np.array([-1.0]))  # diversity down is bad: z = (mu - x) / sd
        counted.append(np.array([True]))
        thresholds.append(np.full(1, self._threshold(1)))
        for metric, sign, streams in (("entropy", -1.0, h), ("concentration", 1.0, h), ("sink_share", 1.0, 2 * h),
                                      ("sink_share", -1.0, 2 * h)):
            moments = ref.per_head[metric]
            means.append(moments.mean)
            sds.append(np.maximum(np.sqrt(np.nan_to_num(moments.variance, nan=0.0)), floors[metric]))
            signs.append(np.full(h, sign))
            counted.append(moments.count > 0)
            thresholds.append(np.full(h, self._threshold(streams)))
        ref.plan = _Plan(np.concatenate(means), np.concatenate(sds), np.concatenate(signs), np.concatenate(counted),
                         np.concatenate(thresholds), ("entropy_collapse", "concentration_spike", "sink_shift",
                                                      "sink_shift"))
        return ref.plan

    @staticmethod
    def _converging_heads(ref: Reference, obs: Observation) -> tuple[str, ...]:
        """Heads whose mean similarity to the others rose by at least half the layer's rise."""
        h = len(obs.heads)
        if h < 2:
            return obs.heads
        off = ~np.eye(h, dtype=bool)
        now = np.where(off, obs.similarity, np.nan)
        before = np.where(off, ref.similarity.mean, np.nan)
        with np.errstate(invalid="ignore"):
            rise = np.nanmean(now, axis=1) - np.nanmean(before, axis=1)
        if not np.isfinite(rise).any():
            return obs.heads
        layer_rise = float(np.nanmean(rise))
        picked = [obs.heads[i] for i in range(h) if np.isfinite(rise[i]) and rise[i] >= layer_rise / 2]
        return tuple(picked) or obs.heads

    # --- state --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"references": [{"key": list(k), "reference": r.to_dict()} for k, r in self.references.items()]}

    def merge_state(self, doc: Mapping[str, Any]) -> None:
        """Merge references from a saved state (another instance, or before a restart)."""
        for item in doc.get("references", []):
            model, revision, layer, bucket = item["key"]
            key = (str(model), str(revision), int(layer), int(bucket))
            other = Reference.from_dict(item["reference"])
            mine = self.references.get(key)
            self.references[key] = other if mine is None or mine.heads != other.heads else mine.merge(other)
