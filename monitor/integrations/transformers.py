"""An attention tap for transformers models: traces from a live model, whatever attention
implementation it runs (sdpa, eager, flash), without changing its outputs.

::

    from monitor.integrations.transformers import attach
    from monitor.producer import TraceProducer

    producer = TraceProducer(bootstrap_servers=..., key_id="team-a", secret=...)
    tap = attach(model, producer, sample_rate=0.01, scope=Scope(tenant="team-a", data_class="internal"))
    producer.publish_contract(tap.contract())
    with tap.request(request_id):              # one id, or one per sequence of a batch
        outputs = model(**inputs)
    tap.detach()                              # flushes; the model's own attention again

How it works. :func:`attach` wraps the model's attention
(:class:`~monitor.integrations.attention_wrapper.AttentionWrapper`): the implementation
the model was loaded with runs unchanged and its output is returned as is, with the very
mask it would see untapped. For sampled requests only, the wrapper then recomputes
the attention weights of ``rows`` sampled query rows per head from the query and key
states it received (after RoPE; KV heads repeated for GQA/MQA), with the model's scaling,
its mask (causal, padding, sliding window; the module's ``is_causal`` when the
implementation got no mask), softcapping and position bias when present. Fused kernels
never materialise the weights; these few rows cost ``rows × keys × head_dim`` per head.

Sampling is decided once per request from a hash of the request id and ``seed``:
reproducible, and the same across layers. Padding comes from the ``attention_mask`` the
model is called with (left or right): a trace covers the sequence's real tokens only.
During generation with a KV cache, rows are sampled from the prompt pass; decoding steps
(one query token) are not traced. Traces go to the sink through a bounded queue and a
background thread (:mod:`monitor.integrations.sender`): the forward pass never waits.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import inspect
import logging
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from monitor.integrations.attention_wrapper import AttentionWrapper
from monitor.integrations.hf_contract import contract_from_config, weights_revision
from monitor.integrations.sender import Sender, TapCounts
from monitor.protocol.model_contract import ModelContract
from monitor.protocol.schema import Scope, TraceHeader, check_identifier

__all__ = ["AttentionTap", "TapCounts", "attach", "contract_from_config", "weights_revision"]

log = logging.getLogger(__name__)
Sink = Callable[[TraceHeader, NDArray[np.float16]], Any]


@dataclass(frozen=True)
class _Plan:
    """What a request's traces cover, the same at every layer: the sampled sequences of
    the batch, their real (not padding) keys and their sampled rows."""

    sequences: torch.Tensor  #: [S] batch index of each traced sequence
    real: torch.Tensor  #: [S, K] True where the key is a real token
    rows: torch.Tensor  #: [S, R] key position of each sampled row (a short sequence repeats its last)
    counts: tuple[int, ...]  #: rows of each sequence
    keys: tuple[NDArray[np.int64], ...]  #: real key positions of each sequence
    positions: tuple[tuple[int, ...], ...]  #: each row's position among the real keys


@dataclass
class _Request:
    """The request(s) of the forward passes inside one ``tap.request`` block."""

    tap: AttentionTap
    request_ids: tuple[str, ...]  #: one per sequence of the batch
    sampled: tuple[bool, ...]
    scope: Scope
    timestamp: float
    padding: torch.Tensor | None = None  #: the 2-D attention mask the model was called with (1 = token)
    plans: dict[tuple[int, int], _Plan | None] = field(default_factory=dict)  #: (keys, offset) → plan
    traced: set[int] = field(default_factory=set)  #: layers already traced


_ACTIVE: contextvars.ContextVar[_Request | None] = contextvars.ContextVar("attention_tap_request", default=None)


@dataclass(frozen=True)
class _Capture:
    """One layer's sampled rows of every traced sequence of a request, as captured."""

    request: _Request
    plan: _Plan
    layer: int
    weights: NDArray[np.float16]  #: [S, H, R, K]


class AttentionTap(AttentionWrapper):
    """See the module documentation; made by :func:`attach`."""

    def __init__(self, model: Any, sink: Sink | Any, *, rows: int, sample_rate: float, layers: Sequence[int] | None,
                 seed: int, model_id: str | None, revision: str | None, scope: Scope, producer_id: str,
                 queue_size: int):
        if rows < 1:
            raise ValueError("rows must be at least 1")
        if not 0 <= sample_rate <= 1:
            raise ValueError("sample_rate must be in [0, 1]")
        self.model = model
        self.rows, self.sample_rate, self.seed = rows, sample_rate, seed
        self.scope, self.producer_id = scope, producer_id
        self._contract = contract_from_config(
            model.config, model_id or getattr(model.config, "name_or_path", None) or type(model).__name__,
            revision or weights_revision(model), scale=_module_scale(model))
        known = {layer.layer for layer in self._contract.layers}
        self.layers = frozenset(known if layers is None else layers)
        if not self.layers <= known:
            raise ValueError(f"layers {sorted(self.layers - known)} are not in the model ({len(known)} layers)")
        #: per layer, a header validated once; traces copy it with their own fields (request
        #: ids are checked at tap.request, positions and key counts agree by construction)
        self._templates = {
            layer.layer: TraceHeader(
                trace_id="template", request_id="template", model_id=self._contract.model_id,
                model_revision=self._contract.model_revision, contract_id=self._contract.contract_id,
                layer=layer.layer, heads=layer.heads, kv_groups=layer.kv_groups, query_positions=(0,), key_count=1,
                mask=self._contract.mask, scale=self._contract.scale, weights_source="recomputed", dtype="float16",
                sample_rate=max(sample_rate, 1e-9), scope=scope, producer_id=producer_id, timestamp=0.0)
            for layer in self._contract.layers}
        send = sink.send if hasattr(sink, "send") else sink
        self._sender = Sender(lambda trace: send(*trace), queue_size, self._traces)
        self._hook = model.register_forward_pre_hook(self._remember_padding, with_kwargs=True)
        self._forward = inspect.signature(model.forward)
        super().__init__(model, "attention-monitor-tap")

    # --- the model owner's verbs ------------------------------------------------------

    def contract(self) -> ModelContract:
        """The model contract of the tapped model (publish it before its traces)."""
        return self._contract

    def sampled(self, request_id: str) -> bool:
        """Whether traces of ``request_id`` are taken: a hash of the id and the seed,
        below the sample rate."""
        digest = hashlib.sha256(f"{self.seed}\0{request_id}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < self.sample_rate

    def _row_seed(self, request_id: str) -> int:
        digest = hashlib.sha256(f"{self.seed}\0{request_id}\0rows".encode()).digest()
        return int.from_bytes(digest[:8], "big")

    @contextlib.contextmanager
    def request(self, request_id: str | Sequence[str], *, scope: Scope | None = None) -> Iterator[None]:
        """Tag the forward passes inside the block with the request id (or one id per
        sequence of a batched input, in batch order)."""
        ids = (request_id,) if isinstance(request_id, str) else tuple(request_id)
        if not ids:
            raise ValueError("give at least one request id")
        for rid in ids:
            check_identifier(rid, "request id")
        state = _Request(self, ids, tuple(self.sampled(r) for r in ids), scope or self.scope, time.time())
        token = _ACTIVE.set(state)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    @property
    def counts(self) -> TapCounts:
        return self._sender.counts()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued trace was handed to the sink; False on timeout."""
        return self._sender.flush(timeout)

    def detach(self, timeout: float | None = None) -> TapCounts:
        """Flush, restore the model's own attention implementation and log the counts."""
        if self.attached:
            self.restore()
            self._hook.remove()
            self._sender.close(timeout)
            log.info("attention tap detached from %s: %s", self._contract.model_id, self.counts.line())
        return self.counts

    # --- inside the forward pass ---------------------------------------------------------

    def _remember_padding(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state = _ACTIVE.get()
        if state is None or state.tap is not self or not any(state.sampled):
            return
        try:
            mask = self._forward.bind_partial(*args, **kwargs).arguments.get("attention_mask")
        except TypeError:
            mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2:
            state.padding = mask.detach()

    @property
    def attached(self) -> bool:
        return self.installed

    def around(self, module: Any, output: Any, query: torch.Tensor, key: torch.Tensor,
               attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> Any:
        state = _ACTIVE.get()
        if state is not None and state.tap is self and any(state.sampled):
            try:
                self._capture(state, module, query, key, attention_mask, kwargs)
            except Exception as exc:  # the tap never breaks the forward pass
                self._sender.failed()
                log.warning("attention tap: capturing failed: %s: %s", type(exc).__name__, exc)
        return output

    def _capture(self, state: _Request, module: Any, query: torch.Tensor, key: torch.Tensor,
                 mask: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
        layer = self.layer(module)
        batch, heads, q_len, _ = query.shape
        k_len = key.shape[2]
        if layer not in self.layers or layer in state.traced or q_len < 2 or heads % max(key.shape[1], 1):
            return  # a decoding step (one query token), a layer traced already, or not one being traced
        if batch != len(state.request_ids):
            raise ValueError(f"{batch} sequences in the batch but {len(state.request_ids)} request ids")
        state.traced.add(layer)
        offset = k_len - q_len  # query i is key offset + i (a prefix in the cache)
        plan = self._plan(state, k_len, offset, key.device)
        if plan is None:
            return
        scaling = float(kwargs.get("scaling") or query.shape[-1] ** -0.5)
        is_causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
        with torch.no_grad():
            weights = _row_weights(query, key, plan, offset, scaling, mask, kwargs, is_causal)
        block = weights.to(torch.float16).cpu().numpy()
        self._sender.offer(_Capture(state, plan, layer, block), traces=len(plan.counts))

    def _plan(self, state: _Request, k_len: int, offset: int, device: torch.device) -> _Plan | None:
        """The request's plan for ``k_len`` keys (made at its first traced layer): real
        keys from the model's 2-D mask, and ``rows`` real query positions per sequence,
        reproducible from the request id and the seed."""
        if (k_len, offset) in state.plans:
            return state.plans[(k_len, offset)]
        padding = state.padding
        real = (padding.to(device) != 0 if padding is not None and padding.shape[-1] == k_len
                else torch.ones(len(state.request_ids), k_len, dtype=torch.bool, device=device))
        chosen = [b for b, sampled in enumerate(state.sampled) if sampled]
        on_host = real.cpu().numpy()[chosen]  # [S, K]
        among_real = np.cumsum(on_host, axis=1) - 1  # each real key's index among the sequence's real keys
        queries = on_host & (np.arange(k_len) >= offset)
        keep: NDArray[np.bool_] = np.asarray(queries.any(axis=1))
        if not keep.any():
            state.plans[(k_len, offset)] = None
            return None
        chosen = [b for b, k in zip(chosen, keep, strict=True) if k]
        on_host, among_real, queries = on_host[keep], among_real[keep], queries[keep]
        seeds = np.array([self._row_seed(state.request_ids[b]) for b in chosen], dtype=np.uint64)
        rank = np.where(queries, _rank(among_real.astype(np.uint64), seeds[:, None]), np.iinfo(np.uint64).max)
        picked = np.argsort(rank, axis=1, kind="stable")[:, : self.rows]  # key positions, best ranked first
        valid = np.take_along_axis(queries, picked, axis=1)
        counts = valid.sum(axis=1)
        last = np.where(valid, picked, -1).max(axis=1, keepdims=True)
        rows = np.sort(np.where(valid, picked, last), axis=1)  # a short sequence repeats its last row
        positions = np.take_along_axis(among_real, rows, axis=1)
        plan = _Plan(
            torch.tensor(chosen, device=device), real[chosen], torch.as_tensor(rows, device=device),
            tuple(int(c) for c in counts), tuple(np.flatnonzero(row) for row in on_host),
            tuple(tuple(int(p) for p in positions[i, : counts[i]]) for i in range(len(chosen))))
        state.plans[(k_len, offset)] = plan
        return plan

    def _traces(self, capture: _Capture) -> list[tuple[TraceHeader, NDArray[np.float16]]]:
        """Header and weights of each sequence of a capture (on the sender thread): the
        rows it sampled, over its real keys."""
        plan, request = capture.plan, capture.request
        template = self._templates[capture.layer]
        out = []
        for i, b in enumerate(plan.sequences.tolist()):
            request_id = request.request_ids[b]
            weights = np.ascontiguousarray(capture.weights[i, :, : plan.counts[i]][:, :, plan.keys[i]])
            trace_id = f"{request_id}/{capture.layer}/{uuid.uuid4().hex[:12]}" if len(request_id) <= 100 \
                else uuid.uuid4().hex
            header = template.model_copy(update={
                "trace_id": trace_id, "request_id": request_id, "query_positions": plan.positions[i],
                "key_count": len(plan.keys[i]), "scope": request.scope, "timestamp": request.timestamp})
            out.append((header, weights))
        return out


def _rank(index: NDArray[np.uint64], seed: NDArray[np.uint64]) -> NDArray[np.uint64]:
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


def _row_weights(query: torch.Tensor, key: torch.Tensor, plan: _Plan, offset: int, scaling: float,
                 mask: torch.Tensor | None, kwargs: dict[str, Any], is_causal: bool) -> torch.Tensor:
    """``[S, H, R, K]`` softmax weights of the planned rows of every traced sequence at
    once; padding keys get no weight."""
    s, r = plan.rows.shape
    heads, groups, k_len, dim = query.shape[1], key.shape[1], key.shape[2], query.shape[3]
    q = query[plan.sequences[:, None], :, plan.rows - offset].transpose(1, 2).float()  # [S, H, R, d]
    k = (key if s == key.shape[0] else key[plan.sequences]).float()  # [S, G, K, d]
    # query head h uses KV head h // (H / G): group the query heads instead of repeating K
    scores = torch.matmul(q.reshape(s, groups, heads // groups * r, dim), k.transpose(-1, -2))
    scores = scores.reshape(s, heads, r, k_len) * scaling
    softcap = kwargs.get("softcap")
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    bias = kwargs.get("position_bias")
    if isinstance(bias, torch.Tensor):
        scores = scores + _pick(bias, plan, offset).float()
    visible = plan.real[:, None, None, :]  # [S, 1, 1, K]
    if mask is None or mask.ndim < 4:  # flash kernels get no mask or the 2-D padding mask (in plan.real)
        keys = torch.arange(k_len, device=scores.device)
        if is_causal:
            visible = visible & (keys <= plan.rows[:, :, None])[:, None]
        window = kwargs.get("sliding_window")
        if window:
            visible = visible & (plan.rows[:, :, None] - keys < window)[:, None]
    elif mask.dtype == torch.bool:
        visible = visible & _pick(mask, plan, offset)
    else:
        additive = _pick(mask, plan, offset).float()
        visible = visible & (additive > torch.finfo(mask.dtype).min / 2)
        scores = scores + torch.where(visible, additive, torch.zeros_like(additive))
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)


def _pick(tensor: torch.Tensor, plan: _Plan, offset: int) -> torch.Tensor:
    """The planned rows of a ``[B or 1, H or 1, Q, K]`` mask or bias: ``[S, H or 1, R, K]``."""
    batch = plan.sequences if tensor.shape[0] > 1 else torch.zeros_like(plan.sequences)
    return tensor[batch[:, None], :, plan.rows - offset].transpose(1, 2)


def _module_scale(model: Any) -> float | None:
    """The softmax scale the model's attention modules use, when they say (one for all)."""
    scales = {float(m.scaling) for m in model.modules() if isinstance(getattr(m, "scaling", None), (int, float))
              and hasattr(m, "is_causal")}
    if len(scales) > 1:
        raise ValueError(f"the attention modules use {len(scales)} different scales; give the contract by hand")
    return scales.pop() if scales else None


def attach(model: Any, sink: Sink | Any, *, rows: int = 4, sample_rate: float = 0.01,
           layers: Sequence[int] | None = None, seed: int = 0, model_id: str | None = None,
           revision: str | None = None, scope: Scope | None = None, producer_id: str | None = None,
           queue_size: int = 1024) -> AttentionTap:
    """Tap ``model``'s attention; traces of sampled requests go to ``sink`` (a
    :class:`~monitor.producer.TraceProducer`, or any callable taking a header and the
    weights). ``model_id`` defaults to the config's name or path, ``revision`` to a
    content hash of the weights, ``scope`` to tenant ``default`` / data class
    ``internal``, ``producer_id`` to this host's name."""
    return AttentionTap(model, sink, rows=rows, sample_rate=sample_rate, layers=layers, seed=seed,
                        model_id=model_id, revision=revision,
                        scope=scope or Scope(tenant="default", data_class="internal"),
                        producer_id=producer_id or socket.gethostname()[:128], queue_size=queue_size)
