"""What the detector takes and gives: an observation of one trace, and its verdict
(anomalies, the evidence beside the reference). Small frozen values; the detector
(:mod:`monitor.core.detect`) is what makes them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from monitor.core.metrics import HeadMetrics
from monitor.core.standardise import Standardised

__all__ = ["Ahead", "Anomaly", "Evidence", "Observation", "Verdict"]


@dataclass(frozen=True)
class Observation:
    """One trace as the detector sees it: whose layer, how many keys, its head ids in
    order, and the metrics core's :class:`~monitor.core.metrics.HeadMetrics` of it."""

    model: str
    revision: str
    layer: int
    key_count: int
    heads: tuple[str, ...]
    metrics: HeadMetrics
    timestamp: float = 0.0  #: the trace's time (seconds since the epoch; 0: unknown), for the request rate
    #: the revision whose reference judges it, as its judge key names it (routing decided it
    #: by :meth:`monitor.core.pins.Pins.judge_revision`); None: decided here by that rule
    judged_by: str | None = None


@dataclass(frozen=True)
class Anomaly:
    kind: str
    layer: int
    heads: tuple[str, ...]
    value: float  #: the observed value (head kinds: that head's)
    reference: float  #: the reference mean it is judged against, at the trace's length
    effect: float  #: standardised effect size of this trace, bad direction positive
    score: float  #: the CUSUM statistic that crossed the threshold
    reference_revision: str
    pages: bool = False  #: the evidence crossed the page threshold (an incident opens on it)


@dataclass(frozen=True)
class Evidence:
    """What an anomalous trace looked like beside its reference, for the triage page:
    the head-similarity matrices (small, no weights) and every head's metrics against
    the reference band at the trace's length."""

    heads: tuple[str, ...]
    key_count: int
    similarity: NDArray[np.float64]  #: this trace's [H, H] head-similarity matrix
    reference_similarity: NDArray[np.float64] | None  #: the reference's mean matrix
    metrics: dict[str, NDArray[np.float64]]  #: entropy, concentration, sink_share: this trace's, per head
    band_mean: dict[str, NDArray[np.float64]]  #: the same metrics' reference mean at this length
    band_sd: dict[str, NDArray[np.float64]]  #: and their reference deviation (floored as in judging)
    diversity: tuple[float, float, float]  #: layer diversity: value, reference mean, reference sd


@dataclass(frozen=True)
class Verdict:
    """What the detector made of one trace."""

    anomalies: list[Anomaly]
    judged_by: str | None  #: the revision whose reference judged the trace; None when none could
    learning: bool  #: the trace taught its revision's own reference
    reference_traces: int  #: traces in the reference that judges this layer (or is learning to)
    ready: bool  #: that reference judges traces
    events: tuple[str, ...] = ()  #: worth a log line: a reference became ready, a pin took effect
    evicted: int = 0  #: references dropped to keep at most ``max_references``
    evidence: Evidence | None = None  #: with anomalies: the trace beside its reference


@dataclass(frozen=True)
class Ahead:
    """What :meth:`Detector.observe` works out of a trace before it touches any state:
    its stream values and, when the reference that judges it was ready, its row of
    ``standardised``. :meth:`Detector.ahead` works them out for many traces at once."""

    values: NDArray[np.float64]
    standardised: Standardised | None = None
    row: int = 0
