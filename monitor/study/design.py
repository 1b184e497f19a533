"""Which heads an ablation is compared with.

Random controls: head sets of the same size and the same layer mix as the set under
study, drawn from the other heads. Magnitude-matched controls: for each head under
study, one of the ``pool`` other heads whose mean output norm is nearest to its own (on
a log scale), so a large effect cannot come from removing a large output alone. Both are
drawn ``draws`` times with the repeat's seed.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

Head = tuple[int, int]  #: (layer, head index)
HEAD_PATTERN = re.compile(r"^(\d+)[.:](?:head-)?(\d+)$")


def parse_heads(text: str) -> tuple[Head, ...]:
    """``"2.3,2.4"`` or ``"2:head-3 2:head-4"`` (as incidents name them) → heads."""
    heads = []
    for item in re.split(r"[,\s]+", text.strip()):
        if not item:
            continue
        match = HEAD_PATTERN.match(item)
        if match is None:
            raise ValueError(f"head {item!r}: write LAYER.HEAD, e.g. 2.3, or LAYER:head-N as incidents name them")
        heads.append((int(match.group(1)), int(match.group(2))))
    if not heads:
        raise ValueError("no heads given")
    if len(set(heads)) != len(heads):
        raise ValueError(f"a head is named twice in {text!r}")
    return tuple(heads)


def head_name(head: Head) -> str:
    return f"{head[0]}.{head[1]}"


def random_controls(target: Sequence[Head], layout: Mapping[int, int], draws: int,
                    rng: np.random.Generator) -> list[tuple[Head, ...]]:
    """``draws`` sets of the target's size and layer mix, none of the target's heads."""
    needed = Counter(layer for layer, _ in target)
    out = []
    for _ in range(draws):
        chosen: list[Head] = []
        for layer, count in sorted(needed.items()):
            others = [h for h in range(layout[layer]) if (layer, h) not in target]
            if len(others) < count:
                raise ValueError(f"layer {layer} has {len(others)} heads outside the set, {count} needed for a "
                                 "random control of the same layer mix")
            picked = rng.choice(len(others), size=count, replace=False)
            chosen += [(layer, others[i]) for i in sorted(picked.tolist())]
        out.append(tuple(chosen))
    return out


def magnitude_controls(target: Sequence[Head], norms: Mapping[Head, float], draws: int, rng: np.random.Generator,
                       pool: int = 3) -> list[tuple[Head, ...]]:
    """``draws`` sets of one output-norm-matched head per target head (distinct, none of
    the target's): each picked among the ``pool`` nearest in log norm."""
    candidates = [h for h in norms if h not in target]
    if len(candidates) < len(target):
        raise ValueError(f"{len(candidates)} heads outside the set, {len(target)} needed for a matched control")
    nearest = {}
    for head in target:
        reference = math.log(max(norms[head], 1e-12))
        nearest[head] = sorted(candidates, key=lambda c: (abs(math.log(max(norms[c], 1e-12)) - reference), c))
    out = []
    for _ in range(draws):
        chosen: list[Head] = []
        for head in target:
            free = [c for c in nearest[head] if c not in chosen][:pool]
            chosen.append(free[int(rng.integers(len(free)))])
        out.append(tuple(sorted(chosen)))
    return out


def split(n: int, holdout: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the selection split (reference data for the means, screening) and of
    the held-out split (the verdict), disjoint, shuffled with the repeat's seed."""
    if not 0 < holdout < 1:
        raise ValueError("holdout must be between 0 and 1")
    order = rng.permutation(n)
    cut = n - max(1, round(n * holdout))
    if cut < 1:
        raise ValueError(f"{n} examples cannot be split into a selection and a held-out part")
    return np.sort(order[:cut]), np.sort(order[cut:])
