"""Which decoding steps of a sampled request the tap keeps, and their rows.

During ``generate`` every step after the prompt runs the attention of one new query
token over the whole KV cache. The tap keeps only a few of a sampled request's steps:
``rows`` spread over the generation, and always the last one. The number of steps is not
known until the request ends, so the steps are kept with a doubling stride: at most
``2 · rows`` are held, every ``stride``-th; when that fills up, the stride doubles and
every other one goes. What remains at the end is evenly spread over the whole
generation, whatever its length; :meth:`DecodeRows.chosen` takes ``rows`` of them and
the last.

Only a step the stride keeps has its row recomputed at once; any other step is held as a
recipe (its query and the cache it saw: references, nothing computed), replaced by the
next, and recomputed only if it turns out to be the last (:meth:`DecodeRows.finish`).
"""

from __future__ import annotations

from collections.abc import Callable
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
    pending: Callable[[], Step] | None = None  #: the latest step, not recomputed (yet)

    def keeps(self, index: int) -> bool:
        """Whether step ``index`` is one the stride keeps (recompute it now)."""
        return self.rows > 0 and index % self.stride == 0

    def offer(self, step: Step) -> None:
        """A recomputed step (one :meth:`keeps`)."""
        self.steps = step.index + 1
        self.last, self.pending = step, None
        self.kept.append(step)
        if len(self.kept) > 2 * self.rows:
            self.stride *= 2
            self.kept = [s for s in self.kept if s.index % self.stride == 0]

    def hold(self, index: int, recompute: Callable[[], Step]) -> None:
        """A step the stride does not keep: remembered as the latest, in case it is the last."""
        self.steps = index + 1
        self.pending = recompute

    def finish(self) -> None:
        """The request ended: recompute its last step if it was only held."""
        if self.pending is not None:
            self.last, self.pending = self.pending(), None

    def chosen(self) -> list[Step]:
        """``rows`` steps spread over the generation, then the last, in step order."""
        if self.last is None:
            return []
        earlier = [s for s in self.kept if s.index != self.last.index]
        if len(earlier) > self.rows:
            picks = np.linspace(0, len(earlier) - 1, self.rows).round().astype(int)
            earlier = [earlier[i] for i in sorted(set(picks.tolist()))]
        return [*earlier, self.last]
