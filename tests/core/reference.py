"""An independent, plain float64 implementation of the metrics, written from the
definitions row by row (loops, no shared code with monitor.core)."""

from __future__ import annotations

import math

import numpy as np


def reference_metrics(weights, valid=None):
    w = np.asarray(weights, dtype=np.float64)
    h_count, r_count, k_count = w.shape
    v = np.ones(w.shape, bool) if valid is None else np.broadcast_to(valid, w.shape)
    probs = [[None] * r_count for _ in range(h_count)]
    for h in range(h_count):
        for i in range(r_count):
            keys = [j for j in range(k_count) if v[h, i, j]]
            mass = sum(w[h, i, j] for j in keys)
            if keys and mass > 0:
                probs[h][i] = {j: w[h, i, j] / mass for j in keys}

    entropy, concentration, sink = [], [], []
    for h in range(h_count):
        ent, conc, snk = [], [], []
        for i in range(r_count):
            p = probs[h][i]
            if p is None:
                continue
            conc.append(max(p.values()))
            snk.append(p.get(0, 0.0))
            if len(p) >= 2:
                ent.append(-sum(x * math.log(x) for x in p.values() if x > 0) / math.log(len(p)))
        entropy.append(sum(ent) / len(ent) if ent else math.nan)
        concentration.append(sum(conc) / len(conc) if conc else math.nan)
        sink.append(sum(snk) / len(snk) if snk else math.nan)

    sim = np.full((h_count, h_count), math.nan)
    for a in range(h_count):
        for b in range(h_count):
            coeffs = [
                sum(math.sqrt(probs[a][i].get(j, 0.0) * probs[b][i].get(j, 0.0)) for j in range(k_count))
                for i in range(r_count)
                if probs[a][i] is not None and probs[b][i] is not None
            ]
            if coeffs:
                sim[a, b] = 1.0 if a == b else sum(coeffs) / len(coeffs)
    heads = [h for h in range(h_count) if not math.isnan(sim[h, h])]
    pairs = [sim[a, b] for a in heads for b in heads if a != b and not math.isnan(sim[a, b])]
    diversity = 1.0 - sum(pairs) / len(pairs) if pairs else math.nan
    squares = sum(sim[a, b] ** 2 for a in heads for b in heads if not math.isnan(sim[a, b]))
    effective = len(heads) ** 2 / squares if heads else math.nan
    return {
        "entropy": np.array(entropy),
        "concentration": np.array(concentration),
        "sink_share": np.array(sink),
        "similarity": sim,
        "diversity": diversity,
        "effective_heads": effective,
    }
