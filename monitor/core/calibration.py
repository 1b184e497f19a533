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

Page thresholds
    :func:`page_arl` turns a false-page budget into the in-control run length every
    stream must have: with ``S`` streams in a revision, each seeing one trace a request
    at ``rate`` requests a second, a revision-week holds ``rate · 604800`` observations of
    each stream; splitting the budget ``B`` equally (Bonferroni, which holds whatever the
    streams' correlation) gives each stream ``ARL = S · rate · 604800 / B``. Adding
    layers or heads adds streams and raises every stream's threshold, so the revision's
    expected false pages stay at ``B`` a week.
"""

from __future__ import annotations

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
