"""Which heads a low-diversity finding names.

Low diversity is a layer-level finding, but on-call needs the heads: those whose
similarity to their nearest other head rose (the streams that crossed, or moved at least
``head_z`` sd), and those that became near copies of one of them, their pair's similarity
risen most above the reference's mean matrix. A group of heads turning into copies of
each other may include heads that already had a near twin, so their own
nearest-neighbour similarity hardly moved; the matrix catches them.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

#: a pair of heads counts as converging when its similarity rose this much above the
#: reference's mean matrix, by at least half the largest rise of the layer, and the two
#: attend nearly alike now (the reference matrix is a mean over all lengths, so a rise
#: alone also catches pairs that are merely more alike on short traces)
PAIR_RISE = 0.2
PAIR_COPY = 0.9


def named_heads(heads: tuple[str, ...], core: set[int], rise: NDArray[np.float64], similarity: NDArray[np.float64],
                reference: NDArray[np.float64] | None) -> tuple[str, ...]:
    """The heads of ``core`` and those that became near copies of one of them (and whose
    standardised nearest-neighbour similarity ``rise`` did not fall). When none: the heads
    whose ``rise`` is at least half the largest; when none rose, every head."""
    joined = joined_heads(similarity, reference, core)
    named = tuple(heads[i] for i in range(len(heads)) if i in core or (i in joined and rise[i] >= 0))
    if named:
        return named
    if not (rise > 0).any():
        return heads
    return tuple(heads[i] for i in range(len(heads)) if rise[i] >= float(rise.max()) / 2)


def joined_heads(similarity: NDArray[np.float64], reference: NDArray[np.float64] | None,
                 core: set[int]) -> set[int]:
    """Heads that became near copies of a head of ``core``, their pair's similarity risen
    most above the reference's mean matrix ``reference``."""
    if not core or reference is None or reference.shape != similarity.shape or similarity.shape[0] < 2:
        return set()
    with np.errstate(invalid="ignore"):
        rise = np.where(np.eye(similarity.shape[0], dtype=bool), np.nan, similarity - reference)
    if not np.isfinite(rise).any():
        return set()
    top = float(np.nanmax(rise))
    if top < PAIR_RISE:
        return set()
    with np.errstate(invalid="ignore"):
        pairs = (rise >= max(PAIR_RISE, top / 2)) & (similarity >= PAIR_COPY)
    members = sorted(core)
    return {int(i) for i in np.flatnonzero(pairs[:, members].any(axis=1))}
