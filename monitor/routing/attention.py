"""Reference multi-head attention as parallel representation routing.

Every query head ``h`` routes the token representations ``x [T, d_model]``
independently through its own projections::

    q_h = x W_q[h]                      [T, d_k]
    k_h = x W_k[g(h)],  v_h = x W_v[g(h)]   (g: the head's KV group; GQA/MQA share them)
    A_h = softmax(mask(scale · q_h k_hᵀ))   [T, T], rows over the keys each query may see
    o_h = A_h v_h                        [T, d_v]

The head outputs are concatenated in declared head order, so coordinates
``[h·d_v, (h+1)·d_v)`` of the concatenation are head ``h``'s and meet rows
``h·d_v … (h+1)·d_v − 1`` of ``W_o``; then ``combined = concat W_o`` and the residual
rejoins: ``output = x + combined``. ``d_k`` and ``d_v`` need not equal ``d_model / H``.

The softmax is the stable one (the row maximum over visible keys is subtracted). A
query row that sees no key (all masked) attends to nothing: its weights and output
are 0. Everything is float64; this is a reference, not a fast path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray

MaskKind = Literal["causal", "bidirectional"]
MASK_KINDS: tuple[MaskKind, ...] = ("causal", "bidirectional")
F64 = NDArray[np.float64]


@dataclass(frozen=True)
class AttentionResult:
    weights: F64  #: ``[H, T, T]`` attention weights of each head
    head_outputs: F64  #: ``[H, T, d_v]`` in declared head order
    combined: F64  #: ``[T, d_model]`` concatenated head outputs times ``W_o``
    output: F64  #: ``[T, d_model]`` ``x + combined``


def visible_keys(tokens: int, mask: MaskKind, padding: NDArray[np.bool_] | None = None) -> NDArray[np.bool_]:
    """``[T, T]``: True where query ``i`` may attend to key ``j``.

    ``causal`` allows ``j ≤ i``; ``bidirectional`` allows every ``j``. ``padding``
    (``[T]``, True for real tokens) removes padded keys in both cases.
    """
    if mask not in MASK_KINDS:
        raise ValueError(f"mask must be one of {MASK_KINDS}, got {mask!r}")
    allowed = np.ones((tokens, tokens), dtype=bool)
    if mask == "causal":
        allowed = np.tril(allowed)
    if padding is not None:
        allowed = allowed & np.asarray(padding, dtype=bool)[None, :]
    return allowed


def stable_softmax(scores: F64, allowed: NDArray[np.bool_]) -> F64:
    """Softmax over the last axis restricted to ``allowed``; rows with nothing allowed are 0."""
    masked = np.where(allowed, scores, -np.inf)
    top = masked.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.where(allowed, np.exp(masked - top), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    result: F64 = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    return result


def multi_head_attention(
    x: F64,
    w_q: Sequence[F64],
    w_k: Sequence[F64],
    w_v: Sequence[F64],
    w_o: F64,
    *,
    mask: MaskKind,
    scale: float,
    padding: NDArray[np.bool_] | None = None,
) -> AttentionResult:
    """Run the routing for one layer.

    ``w_q``, ``w_k`` and ``w_v`` hold one matrix per query head in declared order
    (heads of one KV group pass the same ``W_k``/``W_v``): ``[d_model, d_k]``,
    ``[d_model, d_k]`` and ``[d_model, d_v]``. ``w_o`` is ``[H·d_v, d_model]``.
    """
    x = np.asarray(x, dtype=np.float64)
    allowed = visible_keys(x.shape[0], mask, padding)
    weights, outputs = [], []
    for q_proj, k_proj, v_proj in zip(w_q, w_k, w_v, strict=True):
        q, k, v = x @ q_proj, x @ k_proj, x @ v_proj
        a = stable_softmax(scale * (q @ k.T), allowed)
        weights.append(a)
        outputs.append(a @ v)
    heads = np.stack(outputs)
    concat = np.concatenate(outputs, axis=1)  # head h owns columns [h*d_v, (h+1)*d_v)
    combined = concat @ np.asarray(w_o, dtype=np.float64)
    return AttentionResult(np.stack(weights), heads, combined, x + combined)


def operation_count(tokens: int, d_model: int, d_k: int, d_v: int, heads: int, kv_groups: int) -> int:
    """Floating-point operations of :func:`multi_head_attention` (a multiply-add is 2).

    ``2·T·d_model·(H·d_k + G·(d_k + d_v))`` for the projections, ``2·H·T²·d_k`` for the
    scores, ``4·H·T²`` for scaling and the softmax (scale, subtract, exp, divide),
    ``2·H·T²·d_v`` for weighting the values, ``2·T·H·d_v·d_model`` for the output
    projection and ``T·d_model`` for the residual.
    """
    t = tokens
    projections = 2 * t * d_model * (heads * d_k + kv_groups * (d_k + d_v))
    attention = heads * t * t * (2 * d_k + 4 + 2 * d_v)
    return projections + attention + 2 * t * heads * d_v * d_model + t * d_model
