"""Attention weights of a few query rows, recomputed from the query and key states an
attention implementation received: what the tap publishes, for fused kernels (SDPA,
flash) that never materialise the weights, and the same for eager.

Rows are recomputed exactly as the model computes them: the model's scaling, its mask
(causal, padding, sliding window; the module's ``is_causal`` and the call's
``sliding_window`` when the implementation got no mask), softcapping, a position bias
when one is passed, and a learned sink logit per head when the module has one (gpt-oss:
``module.sinks`` joins the softmax's denominator; the sink's share of each row comes
back beside the keys'). KV heads are not repeated: query heads are grouped instead.
"""

from __future__ import annotations

from typing import Any

import torch


def row_weights(query: torch.Tensor, key: torch.Tensor, sequences: torch.Tensor, rows: torch.Tensor,
                real: torch.Tensor, offset: int, scaling: float, mask: torch.Tensor | None, kwargs: dict[str, Any],
                is_causal: bool, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[S, H, R, K]`` softmax weights of query rows ``rows`` (``[S, R]`` key positions;
    row ``r`` of sequence ``s`` is query ``rows[s, r] - offset``) of the batch's sequences
    ``sequences``, whose real (not padding) keys are ``real [S, K]``; and ``[S, H, R]``
    the learned sink's mass of each row (None without ``sinks``, ``[H]`` logits)."""
    s, r = rows.shape
    heads, groups, k_len, dim = query.shape[1], key.shape[1], key.shape[2], query.shape[3]
    q = query[sequences[:, None], :, rows - offset].transpose(1, 2).float()  # [S, H, R, d]
    k = (key if s == key.shape[0] and bool((sequences == torch.arange(s, device=sequences.device)).all())
         else key[sequences]).float()  # [S, G, K, d]
    # query head h uses KV head h // (H / G): group the query heads instead of repeating K
    scores = torch.matmul(q.reshape(s, groups, heads // groups * r, dim), k.transpose(-1, -2))
    scores = scores.reshape(s, heads, r, k_len) * scaling
    softcap = kwargs.get("softcap")
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    bias = kwargs.get("position_bias")
    if isinstance(bias, torch.Tensor):
        scores = scores + pick(bias, sequences, rows, offset).float()
    visible = real[:, None, None, :]  # [S, 1, 1, K]
    if mask is None or mask.ndim < 4:  # flash kernels get no mask or the 2-D padding mask (in ``real``)
        keys = torch.arange(k_len, device=scores.device)
        if is_causal:
            visible = visible & (keys <= rows[:, :, None])[:, None]
        window = kwargs.get("sliding_window")
        if window:
            visible = visible & (rows[:, :, None] - keys < window)[:, None]
    elif mask.dtype == torch.bool:
        visible = visible & pick(mask, sequences, rows, offset)
    else:
        additive = pick(mask, sequences, rows, offset).float()
        visible = visible & (additive > torch.finfo(mask.dtype).min / 2)
        scores = scores + torch.where(visible, additive, torch.zeros_like(additive))
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1), None
    sink = sinks.float().reshape(1, heads, 1, 1).expand(s, heads, r, 1)
    probabilities = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)
    return probabilities[..., :-1], probabilities[..., -1]


def pick(tensor: torch.Tensor, sequences: torch.Tensor, rows: torch.Tensor, offset: int) -> torch.Tensor:
    """The rows ``rows`` of a ``[B or 1, H or 1, Q, K]`` mask or bias: ``[S, H or 1, R, K]``."""
    batch = sequences if tensor.shape[0] > 1 else torch.zeros_like(sequences)
    return tensor[batch[:, None], :, rows - offset].transpose(1, 2)


def learned_sinks(module: Any) -> torch.Tensor | None:
    """The module's per-head sink logits (gpt-oss's ``sinks``), if it has them."""
    sinks = getattr(module, "sinks", None)
    return sinks.detach() if isinstance(sinks, torch.Tensor) and sinks.ndim == 1 else None
