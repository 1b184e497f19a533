"""The rows of a request traced inside ``tap.request``: its plan (the sampled sequences of
the batch, their real keys, the sampled rows of each, the same at every layer), one
layer's capture of them, and the traces assembled from a capture.

Rows are the ``rows`` real query positions of each sequence ranked first by the request's
row hash (:mod:`~monitor.integrations.row_sampling`), among the prompt's positions from
``first`` on; a sequence with fewer repeats its last. A trace holds the prompt rows,
then the decoding steps kept, each over the sequence's real keys up to the last step (a
row sees none of the keys after it).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from monitor.integrations.decoding import DecodeRows
from monitor.integrations.row_sampling import rank, row_seed
from monitor.protocol.schema import TraceHeader


@dataclass(frozen=True)
class Plan:
    """What a request's traces cover, the same at every layer: the sampled sequences of
    the batch, their real (not padding) keys and their sampled rows."""

    sequences: torch.Tensor  #: [S] batch index of each traced sequence
    real: torch.Tensor  #: [S, K] True where the key is a real token
    rows: torch.Tensor  #: [S, R] key position of each sampled row (a short sequence repeats its last)
    counts: tuple[int, ...]  #: rows of each sequence
    keys: tuple[NDArray[np.int64], ...]  #: real key positions of each sequence
    positions: tuple[tuple[int, ...], ...]  #: each row's position among the real keys


@dataclass
class Capture:
    """One layer's sampled rows of every traced sequence of a request: the prompt's, then
    the decoding steps' kept so far."""

    request: Any  #: the request's state (ids, scope, timestamp)
    plan: Plan
    layer: int
    weights: NDArray[np.float16]  #: [S, H, R, K] of the prompt rows
    sink: NDArray[np.float16] | None  #: [S, H, R]: their learned sink's mass
    decode: DecodeRows
    filled: NDArray[np.bool_]  #: [S, R] the prompt rows computed so far
    real: NDArray[np.bool_] | None = None  #: [S, K'] the traced sequences' real keys at the last step


def make_plan(padding: torch.Tensor | None, request_ids: tuple[str, ...], sampled: tuple[bool, ...], k_len: int,
              offset: int, rows_wanted: int, seed: int, device: torch.device) -> Plan | None:
    """The plan over a prompt's ``k_len`` key positions, its rows among positions
    ``offset`` and later: real keys from the prompt's 2-D mask (``padding``, 1 = token;
    None: all real), and ``rows_wanted`` real query positions per sampled sequence,
    reproducible from the request id and ``seed``; None when no sampled sequence has a
    query there."""
    if padding is not None and padding.shape[-1] <= k_len:  # keys beyond it (a static cache's) are not real
        real = torch.zeros(len(request_ids), k_len, dtype=torch.bool, device=device)
        real[:, : padding.shape[-1]] = padding.to(device) != 0
    else:
        real = torch.ones(len(request_ids), k_len, dtype=torch.bool, device=device)
    chosen = [b for b, sampled in enumerate(sampled) if sampled]
    on_host = real.cpu().numpy()[chosen]  # [S, K]
    among_real = np.cumsum(on_host, axis=1) - 1  # each real key's index among the sequence's real keys
    queries = on_host & (np.arange(k_len) >= offset)
    keep: NDArray[np.bool_] = np.asarray(queries.any(axis=1))
    if not keep.any():
        return None
    chosen = [b for b, k in zip(chosen, keep, strict=True) if k]
    on_host, among_real, queries = on_host[keep], among_real[keep], queries[keep]
    seeds = np.array([row_seed(seed, request_ids[b]) for b in chosen], dtype=np.uint64)
    ranks = np.where(queries, rank(among_real.astype(np.uint64), seeds[:, None]), np.iinfo(np.uint64).max)
    picked = np.argsort(ranks, axis=1, kind="stable")[:, :rows_wanted]  # key positions, best ranked first
    valid = np.take_along_axis(queries, picked, axis=1)
    counts = valid.sum(axis=1)
    last = np.where(valid, picked, -1).max(axis=1, keepdims=True)
    rows = np.sort(np.where(valid, picked, last), axis=1)  # a short sequence repeats its last row
    positions = np.take_along_axis(among_real, rows, axis=1)
    return Plan(
        torch.tensor(chosen, device=device), real[chosen], torch.as_tensor(rows, device=device),
        tuple(int(c) for c in counts), tuple(np.flatnonzero(row) for row in on_host),
        tuple(tuple(int(p) for p in positions[i, : counts[i]]) for i in range(len(chosen))))


def capture_traces(capture: Capture, template: TraceHeader) -> list[tuple[Any, ...]]:
    """Header, weights (and the learned sink's mass) of each sequence of a capture:
    its prompt rows, then its decoding steps', each over the sequence's real keys as of
    the last step."""
    plan, request = capture.plan, capture.request
    steps = capture.decode.chosen()
    out: list[tuple[Any, ...]] = []
    for i, b in enumerate(plan.sequences.tolist()):
        request_id = request.request_ids[b]
        prompt_keys = plan.keys[i]  # the prompt's real key positions
        count = plan.counts[i]
        if steps and capture.real is not None:
            keys = np.flatnonzero(capture.real[i])  # real key positions up to the last step
            total = int(keys[-1]) + 1
            weights = np.zeros((capture.weights.shape[1], count + len(steps), total), np.float16)
            weights[:, :count, : capture.weights.shape[-1]] = capture.weights[i, :, :count]
            for r, step in enumerate(steps):
                weights[:, count + r, : step.keys] = step.weights[i]
            weights = np.ascontiguousarray(weights[:, :, keys])
            among = np.searchsorted(keys, [step.position for step in steps])
            positions = (*plan.positions[i], *(int(p) for p in among))
            extra = {"prompt_length": len(prompt_keys), "key_count": len(keys)}
            sink = None if capture.sink is None else np.ascontiguousarray(np.concatenate(
                [capture.sink[i, :, :count], np.stack([step.sink[i] for step in steps if step.sink is not None],
                                                      axis=-1)], axis=-1))
        else:
            weights = np.ascontiguousarray(capture.weights[i, :, :count][:, :, prompt_keys])
            positions = plan.positions[i]
            extra = {"key_count": len(prompt_keys)}
            sink = None if capture.sink is None else np.ascontiguousarray(capture.sink[i, :, :count])
        trace_id = f"{request_id}/{capture.layer}/{uuid.uuid4().hex[:12]}" if len(request_id) <= 100 \
            else uuid.uuid4().hex
        header = template.model_copy(update={
            "trace_id": trace_id, "request_id": request_id, "query_positions": positions, "scope": request.scope,
            "timestamp": request.timestamp, **extra})
        out.append((header, weights) if sink is None else (header, weights, sink))
    return out
