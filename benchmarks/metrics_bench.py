"""Speed of the metrics core against references measured in the same run.

    OPENBLAS_NUM_THREADS=1 python benchmarks/metrics_bench.py [--repeats N]

For causal float16 traces of each shape it prints ns per element and traces/s of
``head_metrics`` next to, in the same process:

- the log floor: one ``np.log`` pass over a float32 array of the same element count
  (into a preallocated output, so page faults do not flatter the ratio);
- a scipy-based implementation of the same metrics (float64, ``scipy.stats.entropy``,
  Hellinger distances from ``scipy.spatial.distance.cdist``);
- torch on the CPU, when it is installed.

Ratios, not absolute times, are the result: these machines are noisy. Targets
(single thread, ``[32, 64, 4096]``): at most 2x the log floor per element, at least 2x
faster than torch and 5x faster than the scipy-based version.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from monitor.core._blocks import Scratch
from monitor.core.metrics import head_metrics

SHAPES = [((12, 16, 512), 64), ((32, 16, 2048), 8), ((32, 64, 4096), 1)]


def causal_traces(batch: int, h: int, r: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((batch, h, r, k), dtype=np.float32) * 3
    valid = np.arange(k)[None, :] <= np.arange(k - r, k)[:, None]
    logits = np.where(valid, logits, -np.inf)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float16), valid


def best_of(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def scipy_metrics(w: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, ...]:
    from scipy.spatial.distance import cdist
    from scipy.stats import entropy

    p = np.where(valid, w.astype(np.float64), 0.0)
    p /= p.sum(-1, keepdims=True)
    n = valid.sum(-1)
    ent = (entropy(p, axis=-1) / np.log(np.maximum(n, 2))).mean(-1)
    conc = p.max(-1).mean(-1)
    sink = p[..., 0].mean(-1)
    root = np.sqrt(p)
    batch, h, r, _ = p.shape
    sim = np.zeros((batch, h, h))
    for b in range(batch):
        for i in range(r):
            sim[b] += 1 - cdist(root[b, :, i], root[b, :, i], "sqeuclidean") / 2
    sim /= r
    off = ~np.eye(h, dtype=bool)
    return ent, conc, sink, sim, 1 - sim[:, off].mean(-1)


def torch_metrics(w, valid):  # type: ignore[no-untyped-def]
    import torch

    p = torch.where(valid, w.float(), torch.zeros((), dtype=torch.float32))
    p = p / p.sum(-1, keepdim=True)
    n = valid.sum(-1).clamp(min=2)
    ent = (torch.special.entr(p).sum(-1) / torch.log(n.float())).mean(-1)
    conc = p.amax(-1).mean(-1)
    sink = p[..., 0].mean(-1)
    q = p.sqrt().flatten(-2)
    sim = (q @ q.transpose(-1, -2)) / p.shape[-2]
    return ent, conc, sink, sim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="best of N timings (default 5)")
    parser.add_argument("--skip-scipy", action="store_true", help="leave out the slow scipy reference")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time each pass over one cache-sized block of [32, 64, 4096] against the floor")
    args = parser.parse_args()
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        torch = None  # type: ignore[assignment]
    print(f"numpy {np.__version__}; single BLAS thread; best of {args.repeats}")
    print(f"{'shape':>16} {'batch':>5} {'ns/elem':>8} {'traces/s':>9} {'log floor':>9} {'x floor':>7} "
          f"{'scipy x':>8} {'torch x':>8}")
    for (h, r, k), batch in SHAPES:
        w, valid = causal_traces(batch, h, r, k)
        n = w.size
        floor_in = np.random.default_rng(1).random(w.shape, dtype=np.float32)
        floor_out = np.empty_like(floor_in)
        floor = best_of(lambda: np.log(floor_in, out=floor_out), args.repeats)  # noqa: B023
        scratch = Scratch()
        ours = best_of(lambda: head_metrics(w, valid, scratch=scratch), args.repeats)  # noqa: B023
        scipy_ratio = "-"
        if not args.skip_scipy:
            ref = best_of(lambda: scipy_metrics(w, valid), max(1, args.repeats // 2))  # noqa: B023
            scipy_ratio = f"{ref / ours:.1f}"
        torch_ratio = "n/a"
        if torch is not None:
            tw, tv = torch.from_numpy(w), torch.from_numpy(np.ascontiguousarray(valid))
            ref = best_of(lambda: torch_metrics(tw, tv), args.repeats)  # noqa: B023
            torch_ratio = f"{ref / ours:.1f}"
        print(f"{[h, r, k]!s:>16} {batch:>5} {ours / n * 1e9:8.2f} {batch / ours:9.0f} "
              f"{floor / n * 1e9:9.2f} {ours / floor:7.2f} {scipy_ratio:>8} {torch_ratio:>8}")
    print("x floor: our time / log-floor time (target <= 2 on [32, 64, 4096]); "
          "scipy x / torch x: their time / ours (targets >= 5 / >= 2).")
    if args.breakdown:
        breakdown(args.repeats)


def _twenty(run: Callable[[], object]) -> Callable[[], object]:
    return lambda: [run() for _ in range(20)]


def breakdown(repeats: int) -> None:
    """Each pass ``reduce_block`` makes over a block of two rows of [32, 64, 4096], in
    ns per element and as a multiple of the log floor (measured on the whole trace).

    Two of them no exact implementation in numpy can skip: entropy takes the log of
    every weight, and the similarity of 32 heads takes 16 multiply-adds per weight,
    which BLAS's Gram product (the fastest numpy has) does at the speed printed. Their
    sum is printed as a lower bound."""
    from monitor.core._blocks import _TINY, F32, to_float32

    w16, valid = causal_traces(1, 32, 64, 4096)
    block = w16[:, :, :2]
    mask = np.broadcast_to(valid[:2], block.shape)
    w, o = np.empty(block.shape, F32), np.empty(block.shape, F32)
    scratch = Scratch()
    ones = scratch.ones(4096)
    to_float32(block, w, mask, o)
    rows = o.transpose(0, 2, 1, 3)
    passes: dict[str, Callable[[], object]] = {
        "float16 -> float32, masked": lambda: to_float32(block, w, mask, o),
        "row sums (BLAS)": lambda: np.matmul(w, ones),
        "row maxima": lambda: w.max(axis=-1),
        "log2 (of w + tiny)": lambda: np.log2(np.add(w, _TINY, out=o), out=o),
        "w . log w (BLAS)": lambda: np.matmul(w[..., None, :], o[..., :, None]),
        "sqrt": lambda: np.sqrt(w, out=o),
        "Gram matrix per row (BLAS)": lambda: np.matmul(rows, rows.transpose(0, 1, 3, 2)),
    }
    whole = np.random.default_rng(1).random((32, 64, 4096), dtype=np.float32)
    out = np.empty_like(whole)
    floor = best_of(lambda: np.log(whole, out=out), repeats) / whole.size * 1e9
    print(f"\npasses over one block of [32, 64, 4096] (log floor {floor:.2f} ns/elem):")
    total = 0.0
    costs = {}
    for name, run in passes.items():
        costs[name] = cost = best_of(_twenty(run), repeats) / 20 / block.size * 1e9
        total += cost
        print(f"  {name:28s} {cost:5.2f} ns/elem {cost / floor:5.2f}x floor")
    print(f"  {'together':28s} {total:5.2f} ns/elem {total / floor:5.2f}x floor")
    least = costs["log2 (of w + tiny)"] + costs["Gram matrix per row (BLAS)"]
    print(f"least any numpy implementation pays: a log of every weight (entropy) and a Gram product (similarity), "
          f"{least / floor:.2f}x floor, before converting float16 or anything else")


if __name__ == "__main__":
    main()
