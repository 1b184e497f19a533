"""The statistics of a head-ablation study and its verdict, in the policy's words.

For one head set in one repeat (a seed, on one checkpoint), on held-out examples the
choice of heads never saw: the per-example *drop* of the task metric when the set is
ablated (unablated score − ablated score), its mean with a percentile bootstrap
interval over examples; and for each control family (random, magnitude-matched), the
per-example *excess* of the set's drop over the mean drop of the family's draws, with
its bootstrap interval, and the distribution of the draws' own mean drops.

Specialization is ``ESTABLISHED`` only when, in every repeat, for both control
families, the excess interval lies above zero *and* the set's drop interval lies above
the draws' 97.5th percentile (the intervals exclude the controls). Otherwise it is
``NOT_ESTABLISHED``, with the first reason of each failing repeat. A verdict is evidence
about what a head does for this task, never a recommendation to remove it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

ESTABLISHED, NOT_ESTABLISHED = "ESTABLISHED", "NOT_ESTABLISHED"
LEVEL = 0.95
CONTROL_QUANTILE = 0.975


@dataclass(frozen=True)
class Interval:
    mean: float
    lo: float
    hi: float

    @property
    def width(self) -> float:
        return self.hi - self.lo


def bootstrap(values: NDArray[np.float64], resamples: int, rng: np.random.Generator, level: float = LEVEL
              ) -> Interval:
    """The mean of ``values`` (one per example) with a percentile bootstrap interval."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 1 or values.size < 2:
        raise ValueError("a bootstrap needs at least two examples")
    means = np.empty(resamples)
    for start in range(0, resamples, 256):  # bounded memory for large evaluation sets
        stop = min(resamples, start + 256)
        index = rng.integers(0, values.size, size=(stop - start, values.size))
        means[start:stop] = values[index].mean(axis=1)
    tail = (1 - level) / 2
    lo, hi = np.quantile(means, [tail, 1 - tail])
    return Interval(float(values.mean()), float(lo), float(hi))


@dataclass(frozen=True)
class ControlComparison:
    family: str  #: "random" or "magnitude"
    draws: list[list[str]]  #: the heads of every draw
    effects: list[float]  #: each draw's mean drop on the held-out examples
    upper: float  #: the draws' 97.5th percentile
    excess: Interval  #: the set's drop minus the draws' mean drop, per example
    exceeded: bool


@dataclass(frozen=True)
class Repeat:
    checkpoint: str
    seed: int
    examples: int  #: held-out examples
    baseline: Interval  #: the unablated metric on them
    effect: Interval  #: the set's drop
    controls: list[ControlComparison]
    established: bool
    reason: str


def compare(family: str, drop: NDArray[np.float64], control_drops: NDArray[np.float64], draws: list[list[str]],
            effect: Interval, resamples: int, rng: np.random.Generator) -> ControlComparison:
    """The set's per-example drop against a control family's ([draws, examples])."""
    excess = bootstrap(drop - control_drops.mean(axis=0), resamples, rng)
    effects = control_drops.mean(axis=1)
    upper = float(np.quantile(effects, CONTROL_QUANTILE))
    return ControlComparison(family, draws, [float(e) for e in effects], upper, excess,
                             excess.lo > 0 and effect.lo > upper)


def judge(checkpoint: str, seed: int, baseline: NDArray[np.float64], drop: NDArray[np.float64],
          controls: dict[str, tuple[NDArray[np.float64], list[list[str]]]], resamples: int,
          rng: np.random.Generator) -> Repeat:
    """One repeat: the set's drop on held-out data against each control family."""
    effect = bootstrap(drop, resamples, rng)
    compared = [compare(family, drop, drops, draws, effect, resamples, rng)
                for family, (drops, draws) in controls.items()]
    failing = [c for c in compared if not c.exceeded]
    if effect.lo <= 0:
        reason = (f"the ablation effect {effect.mean:.4g} [{effect.lo:.4g}, {effect.hi:.4g}] does not exclude "
                  "zero")
    elif failing:
        c = failing[0]
        reason = (f"the effect {effect.mean:.4g} [{effect.lo:.4g}, {effect.hi:.4g}] does not exceed the "
                  f"{c.family} controls (their 97.5th percentile {c.upper:.4g}; excess {c.excess.mean:.4g} "
                  f"[{c.excess.lo:.4g}, {c.excess.hi:.4g}])")
    else:
        reason = "exceeds both control families with intervals that exclude them"
    return Repeat(checkpoint, seed, int(drop.size), bootstrap(baseline, resamples, rng), effect, compared,
                  effect.lo > 0 and not failing, reason)


@dataclass
class HeadSetResult:
    heads: list[str]
    repeats: list[Repeat] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return ESTABLISHED if self.repeats and all(r.established for r in self.repeats) else NOT_ESTABLISHED

    @property
    def reasons(self) -> list[str]:
        if not self.repeats:
            return ["no repeat ran"]
        if self.verdict == ESTABLISHED:
            return [f"in all {len(self.repeats)} repeats (seeds × checkpoints), on held-out data, the ablation "
                    "effect exceeds random and magnitude-matched controls with intervals that exclude them"]
        return [f"{r.checkpoint} seed {r.seed}: {r.reason}" for r in self.repeats if not r.established]

    def to_dict(self) -> dict[str, Any]:
        return {"heads": self.heads, "verdict": self.verdict, "reasons": self.reasons,
                "repeats": [asdict(r) for r in self.repeats]}
