"""Which decoding steps of a sampled request the tap keeps, and their rows.

During ``generate`` every step after the prompt runs the attention of one new query
token over the whole KV cache. The tap recomputes that query's row at every step of a
sampled request (one row per head: cheap beside the step itself) but keeps only a few:
``rows`` steps spread over the generation, and always the last one. The number of steps
is not known until the request ends, so the steps are kept with a doubling stride: at
most ``2 · rows`` are held, every ``stride``-th; when that fills up, the stride doubles
and every other one goes. What remains at the end is evenly spread over the whole
generation, whatever its length; :meth:`DecodeRows.chosen` takes ``rows`` of them and
the last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray


@dataclass(frozen=True)
class Step:
    """One decoding step's row of each traced sequence."""

    index: int  #: the step (0: the first token after the prompt)
    position: int  #: the query's key position (its own key, the newest in the cache)
    keys: int  #: keys in the cache at this step
    weights: NDArray[np.float16]  #: [S, H, keys]
    sink: NDArray[np.float16] | None  #: [S, H]: the learned sink's mass


@dataclass
class DecodeRows:
    rows: int
    stride: int = 1
    kept: list[Step] = field(default_factory=list)
    last: Step | None = None
    steps: int = 0  #: steps seen

    def wants(self, index: int) -> bool:
        """Whether step ``index`` should be recomputed: every step may be the last."""
        return self.rows > 0

    def offer(self, step: Step) -> None:
        self.steps = step.index + 1
        self.last = step
        if step.index % self.stride:
            return
        self.kept.append(step)
        if len(self.kept) > 2 * self.rows:
            self.stride *= 2
            self.kept = [s for s in self.kept if s.index % self.stride == 0]

    def chosen(self) -> list[Step]:
        """``rows`` steps spread over the generation, then the last, in step order."""
        if self.last is None:
            return []
        earlier = [s for s in self.kept if s.index != self.last.index]
        if len(earlier) > self.rows:
            picks = np.linspace(0, len(earlier) - 1, self.rows).round().astype(int)
            earlier = [earlier[i] for i in sorted(set(picks.tolist()))]
        return [*earlier, self.last]
