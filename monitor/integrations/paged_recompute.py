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

Nothing here reads a value back from the device: the positions come as host integers (the
engine's scheduler knows them), the bounds are checked on the host against them and the
block table's length, and host values go to the device with non-blocking copies. On a GPU
a call only queues kernels; copying its rows out is the caller's business (see
docs/serving-engines.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def host_positions(positions: Sequence[int] | torch.Tensor) -> list[int]:
    """Query positions as host integers: a list, a tuple or a CPU tensor. A tensor on an
    accelerator is refused: reading its values would make the host wait for the device
    (a synchronisation inside the forward pass), and the engine knows the positions on the
    host anyway (its scheduler computed them)."""
    if isinstance(positions, torch.Tensor):
        if positions.device.type != "cpu":
            raise ValueError(f"give the query positions on the host (a list or a CPU tensor), not on "
                             f"{positions.device}: reading them from the device would synchronise it")
        return [int(p) for p in positions.reshape(-1).tolist()]
    return [int(p) for p in positions]


def on_device(values: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` as a long tensor on ``device``; host values are copied without making the
    host wait for the device (``non_blocking``), a tensor already there is used as it is."""
    if isinstance(values, torch.Tensor) and values.device == device:
        return values.long()
    return torch.as_tensor(values, dtype=torch.long).to(device, non_blocking=True)


def slots(block_table: Sequence[int] | torch.Tensor, stop: int, block_size: int, *, start: int = 0,
          block_stride: int | None = None, device: torch.device | None = None) -> torch.Tensor:
    """The cache slots of a sequence's positions ``start … stop − 1``:
    ``block_table[p // block_size] * block_stride + p % block_size`` (``block_stride``
    defaults to ``block_size``), on ``device`` (the block table's by default: the key cache's
    for an adapter, which gives it). The bound is checked on the host, against the table's
    length (a shape): nothing is read back from the device."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    if not 0 <= start <= stop:
        raise ValueError(f"positions {start} … {stop - 1} are not a range of a sequence")
    length = len(block_table) if not isinstance(block_table, torch.Tensor) else int(block_table.shape[-1])
    if stop and (stop - 1) // block_size >= length:
        raise ValueError(f"position {stop - 1} is beyond the {length} blocks of the block table")
    where = device or (block_table.device if isinstance(block_table, torch.Tensor) else torch.device("cpu"))
    table = on_device(block_table, where)
    positions = torch.arange(start, stop, device=where)
    blocks = torch.div(positions, block_size, rounding_mode="floor")
    return table[blocks] * (block_stride or block_size) + positions % block_size


def rows_over_keys(query: torch.Tensor, positions: Sequence[int] | torch.Tensor, keys: torch.Tensor,
                   key_positions: torch.Tensor, scaling: float, *, window: int | None = None,
                   softcap: float | None = None,
                   sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax weights ``[H, R, K]`` (float32) of query rows ``query [H, R, d]`` at absolute
    ``positions [R]`` over ``keys [G, K, d]`` at absolute ``key_positions [K]``, each row
    seeing only the keys its mask shows; and ``[H, R]`` the learned sink's share of each
    row (None without ``sinks``, ``[H]`` logits). Host ``positions`` are copied to the keys'
    device without waiting for it."""
    distance = on_device(positions, key_positions.device)[:, None] - key_positions[None, :]  # [R, K]
    visible = distance >= 0
    if window:
        visible = visible & (distance < window)
    return _softmax_rows(query, keys, scaling, visible, softcap, sinks)


def _softmax_rows(query: torch.Tensor, keys: torch.Tensor, scaling: float, visible: torch.Tensor | None,
                  softcap: float | None, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`rows_over_keys` once the keys each row sees are known: ``visible [R, K]``,
    or None when every row sees every key."""
    heads, rows, dim = query.shape
    groups, count = keys.shape[0], keys.shape[1]
    if heads % groups:
        raise ValueError(f"{heads} query heads cannot share {groups} KV heads evenly")
    q = query.float().reshape(groups, heads // groups * rows, dim)
    scores = torch.matmul(q, keys.float().transpose(-1, -2)).reshape(heads, rows, count) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if visible is not None:
        scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1), None
    sink = sinks.float().reshape(heads, 1, 1).expand(heads, rows, 1)
    probabilities = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)
    return probabilities[..., :-1], probabilities[..., -1]


def paged_rows(query: torch.Tensor, positions: Sequence[int] | torch.Tensor, key_cache: torch.Tensor,
               block_table: Sequence[int] | torch.Tensor, block_size: int, scaling: float, *,
               block_stride: int | None = None, window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows ``[H, R, P]`` of query rows ``query [H, R, d]`` at absolute ``positions [R]`` of
    a sequence whose keys are in ``key_cache`` (``[slots, G, d]``, or pages ``[pages,
    block_size, G, d]``) through ``block_table``, over the sequence's keys ``0 … P − 1``
    (``P = max(positions) + 1``: every key a row can see is already in the cache); keys a
    row does not see weigh 0. Only the keys some row sees are read. And the learned sink's
    share ``[H, R]`` (None without ``sinks``).

    ``positions`` are host integers (a list or a CPU tensor: :func:`host_positions`), which
    the engine's scheduler knows: the keys to read and the bounds to check follow from them
    on the host, so the call never makes the host wait for the device. The block table may
    be on the host or on the cache's device."""
    if key_cache.ndim == 4:  # pages: slot = page * block_size + offset
        key_cache = key_cache.reshape(-1, key_cache.shape[-2], key_cache.shape[-1])
    rows = host_positions(positions)
    if not rows:
        raise ValueError("give at least one query row")
    last = max(rows) + 1
    first = max(0, min(rows) - window + 1) if window else 0
    where = slots(block_table, last, block_size, start=first, block_stride=block_stride, device=key_cache.device)
    keys = key_cache[where].transpose(0, 1)  # [G, K, d]
    if min(rows) == last - 1:  # one position (a decoding step): it sees every key read, no mask to build
        weights, sink = _softmax_rows(query, keys, scaling, None, softcap, sinks)
    else:
        key_positions = torch.arange(first, last, device=key_cache.device)
        weights, sink = rows_over_keys(query, rows, keys, key_positions, scaling, window=window, softcap=softcap,
                                       sinks=sinks)
    if first:
        weights = torch.nn.functional.pad(weights, (first, 0))
    return weights, sink
