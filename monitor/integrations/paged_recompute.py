"""Attention rows recomputed from a paged KV cache, tied to no engine: a few query rows of
one sequence, the sequence's block table (or slot indices), the layer's key cache, and its
mask (causal, sliding window), softcap and learned sinks in; the rows' softmax weights
over the sequence's keys out.

Engines that batch continuously keep keys in fixed-size blocks of a shared cache and give
each sequence a block table: the key at absolute position ``p`` lives in slot
``block_table[p // block_size] * block_stride + p % block_size`` of the layer's cache
viewed as ``[slots, kv_heads, head_dim]`` (vLLM's slot mapping has ``block_stride ==
block_size``; transformers' continuous batching interleaves layers and keys/values in its
blocks, so a block's stride is larger). Rows are computed as the model computes them:
``softmax(scaling · q·k)`` over the keys a row sees (``key ≤ row`` and, with a window,
``row − key < window``), logits softcapped as ``tanh(x / c) · c``, and a learned sink
logit per head joining the softmax's denominator (gpt-oss), whose share of each row comes
back beside the keys'. Query heads are grouped over KV heads (GQA/MQA) rather than
repeating the keys. A continuous-batching adapter (transformers' here, a vLLM or SGLang
attention-backend wrapper elsewhere) only has to say which query rows are which positions
of which sequence and where that sequence's blocks are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def slots(block_table: Sequence[int] | torch.Tensor, positions: torch.Tensor, block_size: int,
          block_stride: int | None = None) -> torch.Tensor:
    """The cache slot of each absolute position of a sequence (``positions``, any shape):
    ``block_table[p // block_size] * block_stride + p % block_size`` (``block_stride``
    defaults to ``block_size``)."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    table = torch.as_tensor(block_table, dtype=torch.long, device=positions.device)
    blocks = torch.div(positions, block_size, rounding_mode="floor")
    if positions.numel() and int(blocks.max()) >= table.numel():
        raise ValueError(f"position {int(positions.max())} is beyond the {table.numel()} blocks of the block table")
    return table[blocks] * (block_stride or block_size) + positions % block_size


def rows_over_keys(query: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, key_positions: torch.Tensor,
                   scaling: float, *, window: int | None = None, softcap: float | None = None,
                   sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax weights ``[H, R, K]`` (float32) of query rows ``query [H, R, d]`` at absolute
    ``positions [R]`` over ``keys [G, K, d]`` at absolute ``key_positions [K]``, each row
    seeing only the keys its mask shows; and ``[H, R]`` the learned sink's share of each
    row (None without ``sinks``, ``[H]`` logits)."""
    heads, rows, dim = query.shape
    groups, count = keys.shape[0], keys.shape[1]
    if heads % groups:
        raise ValueError(f"{heads} query heads cannot share {groups} KV heads evenly")
    q = query.float().reshape(groups, heads // groups * rows, dim)
    scores = torch.matmul(q, keys.float().transpose(-1, -2)).reshape(heads, rows, count) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    distance = positions.to(key_positions.device)[:, None] - key_positions[None, :]  # [R, K]
    visible = distance >= 0
    if window:
        visible = visible & (distance < window)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1), None
    sink = sinks.float().reshape(heads, 1, 1).expand(heads, rows, 1)
    probabilities = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)
    return probabilities[..., :-1], probabilities[..., -1]


def paged_rows(query: torch.Tensor, positions: torch.Tensor, key_cache: torch.Tensor,
               block_table: Sequence[int] | torch.Tensor, block_size: int, scaling: float, *,
               block_stride: int | None = None, window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows ``[H, R, P]`` of query rows ``query [H, R, d]`` at absolute ``positions [R]`` of
    a sequence whose keys are in ``key_cache`` (``[slots, G, d]``, or pages ``[pages,
    block_size, G, d]``) through ``block_table``, over the sequence's keys ``0 … P − 1``
    (``P = max(positions) + 1``: every key a row can see is already in the cache); keys a
    row does not see weigh 0. Only the keys some row sees are read. And the learned sink's
    share ``[H, R]`` (None without ``sinks``)."""
    if key_cache.ndim == 4:  # pages: slot = page * block_size + offset
        key_cache = key_cache.reshape(-1, key_cache.shape[-2], key_cache.shape[-1])
    if positions.numel() == 0:
        raise ValueError("give at least one query row")
    last = int(positions.max()) + 1
    first = max(0, int(positions.min()) - window + 1) if window else 0
    key_positions = torch.arange(first, last, device=key_cache.device)
    keys = key_cache[slots(block_table, key_positions, block_size, block_stride)].transpose(0, 1)  # [G, K, d]
    weights, sink = rows_over_keys(query, positions, keys, key_positions, scaling, window=window, softcap=softcap,
                                   sinks=sinks)
    if first:
        weights = torch.nn.functional.pad(weights, (first, 0))
    return weights, sink
