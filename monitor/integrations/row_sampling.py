"""Which requests a tap traces and which of their query rows: both decided by hashes, so
the same request id and seed give the same answer on every layer, in every process and
on every path (``generate``, continuous batching).

A request is sampled when a hash of its id and the seed falls below the sample rate; a
higher rate samples every request a lower one does. A sampled request's rows are the
``rows`` candidate positions ranked first by a 64-bit mixing hash (splitmix64's
finaliser) of (row seed, position): a reproducible, well-spread sample.
"""

from __future__ import annotations

import hashlib

import numpy as np
from numpy.typing import NDArray


def request_sampled(seed: int, request_id: str, sample_rate: float) -> bool:
    """Whether ``request_id`` is traced at ``sample_rate`` (a hash of the id and seed below it)."""
    digest = hashlib.sha256(f"{seed}\0{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < sample_rate


def row_seed(seed: int, request_id: str) -> int:
    """The seed of a request's row choice."""
    digest = hashlib.sha256(f"{seed}\0{request_id}\0rows".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def rank(index: NDArray[np.uint64], seed: NDArray[np.uint64] | np.uint64) -> NDArray[np.uint64]:
    """A 64-bit mixing hash of (seed, index) (splitmix64's finaliser): ranking a
    sequence's candidate rows by it picks a reproducible, well-spread sample."""
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64 is the point
        x = (index + seed) * np.uint64(0x9E3779B97F4A7C15)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def pick_positions(first: int, end: int, count: int, seed: int) -> tuple[int, ...]:
    """``count`` positions of ``first … end − 1`` (all of them when fewer), ranked by
    their hash under ``seed``, in increasing order."""
    candidates = np.arange(first, max(first, end), dtype=np.uint64)
    order = np.argsort(rank(candidates, np.uint64(seed)), kind="stable")[:count]
    return tuple(int(p) for p in np.sort(candidates[order]))
