"""How far to trust a reference's own deviation, measured on traces it did not learn from,
and the thresholds that spend a false-page budget.

Scale
    A reference learnt from a hundred traces predicts each stream with a local linear fit
    (:mod:`monitor.core.reference`), and its own residual deviation understates how far a
    new trace falls from that fit: the fit itself is an estimate, and real head metrics
    have heavier tails than a normal law. :func:`cross_fitted_scale` measures it where it
    matters, on traces the fit never saw: the reference's traces are split into ``folds``;
    each fold is standardised against a reference learnt from the others, and for each
    family of streams (layer diversity; each head's nearest-neighbour similarity, entropy,
    concentration, sink share, learned sink and prompt mass, each way) the root mean square of those standardised
    values, clipped at ``clip`` as the detector clips them, is the family's scale. The
    detector divides a trace's effects by it (never by less than 1), so a CUSUM sees
    increments of about unit variance on healthy traffic, as its thresholds assume.

Thresholds
    :func:`page_arl` turns a false-page budget into the in-control run length every
    stream must have: with ``S`` streams in a revision, each seeing one trace a request
    at ``rate`` requests a second, a revision-week holds ``rate · 604800`` observations of
    each stream; splitting the budget ``B`` equally (Bonferroni, which holds whatever the
    streams' correlation) gives each stream ``ARL = S · rate · 604800 / B``. Adding
    layers or heads adds streams and raises every stream's threshold, so the revision's
    expected false pages stay at ``B`` a week.

    :func:`corrected_threshold` turns a run length into the threshold ``h``, correcting
    for the reference's estimation error. A reference learnt from ``n`` traces predicts
    each stream's mean with an error of about ``1/√n`` of its deviation, a different error
    for every stream and fixed as long as the reference judges (measured by replaying
    healthy requests of two corpora: the standardised streams' means spread with a
    standard deviation of 0.05–0.09 at ``n = 200``; ``benchmarks/false_pages.py``). A
    stream whose mean is off by ``b`` feeds its CUSUM increments of mean ``b − k``, not
    ``−k``, and its run length shrinks exponentially with ``b``: thresholds from the
    unbiased model (Siegmund's) let the replay's most biased streams page and find far
    more often than their budgets allow (docs/detection.md). Its deviation is an estimate
    too: the same replays measured each stream's increments with a variance ``v`` times
    the reference's, ``log v`` spread with a standard deviation of 0.19–0.22 in every
    reference (``VARIANCE_ERROR``), and a stream of ``v > 1`` runs as a CUSUM of unit
    variance with threshold ``h/√v`` and drift ``(b − k)/√v``: where a biased mean and a
    wide variance met (one reference in six), a correction for the mean alone left 38
    times the page budget. So ``h`` is the threshold whose false-alarm rate *averaged
    over both errors*, ``E[1 / ARL(h/√v; (b − k)/√v)]`` with ``b ~ N(0, 1/n)`` and ``log v
    ~ N(0, VARIANCE_ERROR/n)`` (Siegmund's approximation for each), is ``1 / ARL``, and
    never more than ``MAX_CORRECTION`` times the unbiased model's. The larger ``k`` the
    less an error in the mean moves a stream's drift, which is why the detector's ``k``
    is 0.75 (``DetectorConfig.shift`` 1.5).

    The detector (:mod:`monitor.core.detect`) computes both of its thresholds so, with
    ``n = REFERENCE_TRACES``: the page threshold from :func:`page_arl`
    (``FALSE_PAGES_PER_WEEK``) and the finding threshold from ``FALSE_ALARM_ARL``. The
    correction shrinks as the reference grows; a small reference gets higher thresholds,
    so a fault takes more traces to be found and to page.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from monitor.core.reference import LengthReference
from monitor.core.standardise import Streams, standardise

WEEK_S = 604_800.0
#: the request rate a page threshold assumes at least (requests per second)
RATE_FLOOR = 1.0


def family_blocks(heads: int, streams: int) -> list[slice]:
    """The families of a layer's ``streams`` streams, in judging order: layer diversity,
    then one block of ``heads`` per head stream (nearest-neighbour similarity, entropy,
    concentration, sink share up and down, …: :class:`~monitor.core.standardise.Streams`)."""
    return [slice(0, 1), *(slice(1 + i * heads, 1 + (i + 1) * heads) for i in range((streams - 1) // heads))]


def cross_fitted_scale(streams: Streams, samples: Sequence[tuple[int, NDArray[np.float64]]], *, pool: int,
                       clip: float, folds: int = 5) -> NDArray[np.float64]:
    """Per stream in judging order (``1 + 5H``), the scale of its standardised values on
    traces the reference did not learn from (see the module documentation); ones when
    there are too few samples to tell. ``samples`` are (key count, ``1 + 4H`` values)."""
    heads = len(streams.block["entropy"])
    scale = np.ones(len(streams.pick))
    if folds < 2 or len(samples) < 2 * folds:
        return scale
    parts = []
    for fold in range(folds):
        learnt = LengthReference(len(samples[0][1]))
        held = []
        for i, (key_count, values) in enumerate(samples):
            if i % folds == fold:
                held.append((key_count, values))
            else:
                learnt.update(key_count, values)
        table = standardise(streams, [learnt] * len(held), [k for k, _ in held], np.stack([v for _, v in held]),
                            pool=min(pool, learnt.traces), clip=clip, k=0.0, min_effect=math.inf)
        parts.append(np.where(np.isfinite(table.x) & np.isfinite(table.mean), table.z, np.nan))
    z = np.concatenate(parts)
    for block in family_blocks(heads, len(streams.pick)):
        values = z[:, block]
        values = values[np.isfinite(values)]
        if values.size:
            scale[block] = max(1.0, float(np.sqrt(np.mean(np.clip(values, -clip, clip) ** 2))))
    return scale


def page_arl(streams: int, rate: float | None, budget_per_week: float) -> float:
    """The in-control run length (observations) each of a revision's ``streams`` streams
    needs so that the revision pages falsely ``budget_per_week`` times a week at ``rate``
    requests a second (never assumed below ``RATE_FLOOR``)."""
    if budget_per_week <= 0:
        raise ValueError("the false-page budget must be positive")
    return max(streams, 1) * max(rate or 0.0, RATE_FLOOR) * WEEK_S / budget_per_week


def cusum_run_length(h: float, drift: float) -> float:
    """Siegmund's in-control ARL of a one-sided CUSUM with threshold ``h`` whose
    increments have unit variance and mean ``drift`` (``−k`` for an unbiased reference):
    ``(e^{−2μb} + 2μb − 1) / 2μ²`` with ``b = h + 1.166``; returned as its logarithm
    (the run lengths here exceed any float)."""
    b = h + 1.166
    if abs(drift) < 1e-12:
        return 2 * math.log(b)
    a = -2 * drift * b
    if a > 40:  # e^a dominates
        return a - math.log(2 * drift * drift)
    return math.log((math.exp(a) - a - 1) / (2 * drift * drift))


#: a reference of ``n`` traces misjudges each stream's variance by a factor ``v`` with
#: ``log v ~ N(0, VARIANCE_ERROR / n)``: 2 for normal values; measured on replayed healthy
#: text (each stream's increment variance against its reference's, ``benchmarks/false_pages.py``):
#: ``log v`` spread with a standard deviation of 0.19–0.22 in each of six 200-trace
#: references, ``√(8 / 200) = 0.2``
VARIANCE_ERROR = 8.0

#: Gauss–Hermite nodes and weights (probabilists'), for expectations over a normal error:
#: of a stream's mean (``_MEAN``) and of the logarithm of its variance (``_VARIANCE``)
_MEAN, _MEAN_W = np.polynomial.hermite_e.hermegauss(81)
_VARIANCE, _VARIANCE_W = np.polynomial.hermite_e.hermegauss(41)
_MEAN_W, _VARIANCE_W = _MEAN_W / _MEAN_W.sum(), _VARIANCE_W / _VARIANCE_W.sum()


def log_run_lengths(h: NDArray[np.float64], drift: NDArray[np.float64]) -> NDArray[np.float64]:
    """:func:`cusum_run_length` elementwise, for arrays of thresholds and drifts."""
    b = h + 1.166
    a = -2 * drift * b
    safe = np.where(np.abs(drift) < 1e-12, 1.0, drift)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        grows = np.where(np.abs(a) < 1e-4, a * a / 2 + a ** 3 / 6, np.expm1(np.minimum(a, 40.0)) - a)
        out = np.where(a > 40, a - np.log(2 * safe * safe), np.log(grows / (2 * safe * safe)))
    return np.where(np.abs(drift) < 1e-12, 2 * np.log(b), out)


def false_alarm_rate(h: float, k: float, reference_traces: int, variance_error: float = VARIANCE_ERROR) -> float:
    """Expected false alarms per observation of a stream judged against a reference of
    ``n = reference_traces`` traces: ``E[1 / ARL(h; b − k)]`` over the reference's error in
    the stream's mean, ``b ~ N(0, 1/n)``, and in its variance, the stream's increments
    having ``v`` times the variance the reference gives them, ``log v ~ N(0,
    variance_error / n)`` (a CUSUM of increments of mean ``b − k`` and variance ``v`` is one
    of unit variance, threshold ``h / √v`` and drift ``(b − k) / √v``)."""
    n = max(reference_traces, 1)
    b = _MEAN[:, None] / math.sqrt(n)
    sd = np.exp(_VARIANCE[None, :] * math.sqrt(max(variance_error, 0.0) / n) / 2)
    rates = np.exp(-log_run_lengths(h / sd, (b - k) / sd))
    return float(_MEAN_W @ rates @ _VARIANCE_W)


#: a corrected threshold is at most this many times the unbiased model's (a reference too
#: small for its budget then finds and pages more often than the budget, never not at all)
MAX_CORRECTION = 2.0


@functools.lru_cache(maxsize=256)
def corrected_threshold(arl: float, k: float, reference_traces: int,
                        variance_error: float = VARIANCE_ERROR) -> float:
    """``h`` whose expected false-alarm rate over the reference's estimation error
    (:func:`false_alarm_rate`) is ``1 / arl`` (see the module documentation), between
    the unbiased model's threshold and ``MAX_CORRECTION`` times it."""
    if arl <= 1 or k <= 0:
        raise ValueError("arl must exceed 1 and k must be positive")
    lo = unbiased = _unbiased_threshold(arl, k)
    hi = MAX_CORRECTION * unbiased
    if false_alarm_rate(hi, k, reference_traces, variance_error) > 1 / arl:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if false_alarm_rate(mid, k, reference_traces, variance_error) > 1 / arl else (lo, mid)
    return hi


def _unbiased_threshold(arl: float, k: float) -> float:
    """Siegmund's threshold for drift ``−k`` (the detector's ``cusum_threshold``)."""
    target = math.log(arl)
    lo, hi = 0.0, 1.0
    while cusum_run_length(hi, -k) < target:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cusum_run_length(mid, -k) < target else (lo, mid)
    return hi
