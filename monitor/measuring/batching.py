"""Which traces of a chunk are measured together, and their batch.

The metrics core measures a batch ``[B, H, R, K]`` in one call, and a call has a fixed
cost beside its traces' elements, which weighs most on small traces
(``docs/performance.md``). Traces of one shape share that cost; but a model server's
traces seldom share a key count, since it follows each request's length. So traces of the same heads, rows and
dtype are measured together when their key counts are close: each is padded with zero
weight on keys marked not valid, up to the group's largest. That changes no metric
(padded keys carry no mass and are not counted), beyond float32 rounding in the sums
(the core's batches already differ from single traces by as much). The padding is at
most ``PAD_FRACTION`` of the group's largest key count, so no trace costs more than a
third more than alone.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

#: a trace joins a group when the group's largest key count exceeds its own by at most
#: this fraction of that largest
PAD_FRACTION = 0.25


class Weighed(Protocol):
    @property
    def weights(self) -> NDArray[np.generic]: ...  # [H, R, K]

    @property
    def valid(self) -> NDArray[np.bool_]: ...  # [R, K]


def groups(traces: Sequence[Weighed]) -> list[list[int]]:
    """Indices of ``traces`` in groups measured together: same heads, rows and dtype,
    key counts within ``PAD_FRACTION`` of the group's largest; in record order within a
    group, and the groups in the order of their first trace."""
    by_kind: dict[tuple[int, int, str], list[int]] = defaultdict(list)
    for j, trace in enumerate(traces):
        h, r, _ = trace.weights.shape
        by_kind[(h, r, trace.weights.dtype.str)].append(j)
    out: list[list[int]] = []
    for members in by_kind.values():
        widest_first = sorted(members, key=lambda j: -traces[j].weights.shape[-1])
        group: list[int] = []
        for j in widest_first:
            if group and traces[j].weights.shape[-1] < (1 - PAD_FRACTION) * traces[group[0]].weights.shape[-1]:
                out.append(sorted(group))
                group = []
            group.append(j)
        out.append(sorted(group))
    return sorted(out, key=lambda g: g[0])


def batch(traces: Sequence[Weighed]) -> tuple[NDArray[np.generic], NDArray[np.bool_]]:
    """``weights [B, H, R, K]`` and ``valid [B, 1, R, K]`` of a group, ``K`` its largest
    key count; the keys a trace lacks have weight 0 and are not valid."""
    widest = max(t.weights.shape[-1] for t in traces)
    if all(t.weights.shape[-1] == widest for t in traces):
        return np.stack([t.weights for t in traces]), np.stack([t.valid for t in traces])[:, None]
    h, r, _ = traces[0].weights.shape
    weights = np.zeros((len(traces), h, r, widest), traces[0].weights.dtype)
    valid = np.zeros((len(traces), 1, r, widest), bool)
    for i, t in enumerate(traces):
        k = t.weights.shape[-1]
        weights[i, :, :, :k] = t.weights
        valid[i, 0, :, :k] = t.valid
    return weights, valid
