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

During ``generate`` (a KV cache, ``DynamicCache`` or ``StaticCache``; batched with left
padding too), a sampled request's trace of a layer holds ``rows`` rows of the prompt and
``decode_rows`` decoding steps spread over the generation plus the last
(:mod:`monitor.integrations.decoding`), each recomputed from the step's query and the
cache it saw, each causal at its own position; ``prompt_length`` says where the prompt
ends. Beam search (more sequences than request ids) is refused with a clear message
and counted as failed. A layer with learned sink logits (gpt-oss) gets them in its
softmax, and each row's sink mass travels beside its weights; a sliding-window layer
says its window. A request's traces are published when its ``tap.request`` block ends,
through a bounded queue and a background thread (:mod:`monitor.integrations.sender`):
the forward pass never waits.
"""

from __future__ import annotations

import contextlib
import contextvars
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
from monitor.integrations.continuous_batching import ContinuousBatching, Stream
from monitor.integrations.decoding import DecodeRows, Step
from monitor.integrations.hf_contract import contract_from_config, model_revision, weights_revision
from monitor.integrations.recompute import learned_sinks, row_weights
from monitor.integrations.row_sampling import rank, request_sampled, row_seed
from monitor.integrations.sender import Sender, TapCounts
from monitor.protocol.model_contract import ModelContract
from monitor.protocol.schema import Scope, TraceHeader, check_identifier

__all__ = ["AttentionTap", "TapCounts", "attach", "contract_from_config", "model_revision", "weights_revision"]

log = logging.getLogger(__name__)
Sink = Callable[..., Any]  #: (header, weights[, sink mass]) -> anything


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
    padding: torch.Tensor | None = None  #: the 2-D attention mask the model was called with last (1 = token)
    left: torch.Tensor | None = None  #: [batch] left padding of the prompt, when no 2-D mask says it
    cached: int | None = None  #: keys in the cache before the current forward (None: no cache seen)
    plans: dict[tuple[int, int], _Plan | None] = field(default_factory=dict)  #: (keys, offset) → plan
    captures: dict[int, _Capture] = field(default_factory=dict)  #: layer → its prompt rows (and decode rows)


_ACTIVE: contextvars.ContextVar[_Request | None] = contextvars.ContextVar("attention_tap_request", default=None)


@dataclass
class _Capture:
    """One layer's sampled rows of every traced sequence of a request: the prompt's, then
    the decoding steps' kept so far."""

    request: _Request
    plan: _Plan
    layer: int
    weights: NDArray[np.float16]  #: [S, H, R, K] of the prompt rows
    sink: NDArray[np.float16] | None  #: [S, H, R]: their learned sink's mass
    decode: DecodeRows
    real: NDArray[np.bool_] | None = None  #: [S, K'] the traced sequences' real keys at the last step


class AttentionTap(AttentionWrapper):
    """See the module documentation; made by :func:`attach`."""

    def __init__(self, model: Any, sink: Sink | Any, *, rows: int, sample_rate: float, layers: Sequence[int] | None,
                 seed: int, model_id: str | None, revision: str | None, scope: Scope, producer_id: str,
                 queue_size: int, decode_rows: int = 4):
        if rows < 1:
            raise ValueError("rows must be at least 1")
        if decode_rows < 0:
            raise ValueError("decode_rows must be 0 (no decoding steps traced) or more")
        self.decode_rows = decode_rows
        if not 0 <= sample_rate <= 1:
            raise ValueError("sample_rate must be in [0, 1]")
        self.model = model
        self.rows, self.sample_rate, self.seed = rows, sample_rate, seed
        self.scope, self.producer_id = scope, producer_id
        self._contract = contract_from_config(
            model.config, model_id or getattr(model.config, "name_or_path", None) or type(model).__name__,
            revision or model_revision(model), scale=_module_scale(model), sinks=_sink_layers(model))
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
                mask=self._contract.mask, window=layer.window, learned_sink=bool(layer.learned_sink),
                scale=self._contract.scale, weights_source="recomputed", dtype="float16",
                sample_rate=max(sample_rate, 1e-9), scope=scope, producer_id=producer_id, timestamp=0.0)
            for layer in self._contract.layers}
        send = sink.send if hasattr(sink, "send") else sink
        self._sender = Sender(lambda trace: send(*trace), queue_size, self._expand)
        self._batching = ContinuousBatching(
            rows=rows, decode_rows=decode_rows, layers=self.layers, scope=scope, sampled=self.sampled,
            row_seed=lambda request_id: row_seed(seed, request_id), traceable=self._traceable,
            publish=lambda stream: self._sender.offer(stream, traces=len(stream.layers)), untraced=self._untraced,
            layer_of=self.layer)
        self._hook = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        self._after = model.register_forward_hook(lambda *_: self._batching.after_forward())
        self._forward = inspect.signature(model.forward)
        super().__init__(model, "attention-monitor-tap")

    # --- the model owner's verbs ------------------------------------------------------

    def contract(self) -> ModelContract:
        """The model contract of the tapped model (publish it before its traces)."""
        return self._contract

    def sampled(self, request_id: str) -> bool:
        """Whether traces of ``request_id`` are taken: a hash of the id and the seed,
        below the sample rate."""
        return request_sampled(self.seed, request_id, self.sample_rate)

    def identify(self, engine_request_id: str, request_id: str, *, scope: Scope | None = None) -> None:
        """Under continuous batching, trace the engine's request ``engine_request_id`` (the
        id given to ``add_request``) under ``request_id`` (the id the client and the
        outcome know, e.g. an HTTP completion id), in ``scope`` (the tap's by default).
        Call it before adding the request; sampling then follows ``request_id``. Without
        it a request is traced under its engine id (``generate_batch``'s own ids)."""
        check_identifier(request_id, "request id")
        self._batching.identify(engine_request_id, request_id, scope)

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
            for capture in state.captures.values():  # the request is done: its traces go
                try:
                    capture.decode.finish()
                except Exception as exc:  # the tap never breaks the model's caller
                    self._sender.failed(len(capture.plan.counts))
                    log.warning("attention tap: the last decoding step failed: %s: %s", type(exc).__name__, exc)
                    continue
                self._sender.offer(capture, traces=len(capture.plan.counts))

    @property
    def counts(self) -> TapCounts:
        return self._sender.counts()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued trace was handed to the sink; False on timeout. The
        traces of continuous-batching requests that left their manager without a last
        output (cancelled, or the manager stopped) go first."""
        self._batching.sweep()
        return self._sender.flush(timeout)

    def detach(self, timeout: float | None = None) -> TapCounts:
        """Publish what is traced (a continuous-batching request still running: the rows it
        has so far), flush, stop wrapping the model's attention and log the counts."""
        if self.attached:
            self.restore()
            self._hook.remove()
            self._after.remove()
            self._batching.close()
            self._sender.close(timeout)
            log.info("attention tap detached from %s: %s", self._contract.model_id, self.counts.line())
        return self.counts

    # --- inside the forward pass ---------------------------------------------------------

    def _before_forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            if self._batching.before_forward(kwargs):
                return
            self._remember_padding(args, kwargs)
        except Exception as exc:  # the tap never breaks the forward pass
            self._sender.failed()
            log.warning("attention tap: reading the forward pass's inputs failed: %s: %s", type(exc).__name__, exc)

    def _traceable(self, request_id: str) -> bool:
        try:
            check_identifier(request_id, "request id")
        except ValueError as exc:
            if not request_id.startswith("__warmup"):  # continuous batching's own warm-up requests
                self._untraced("request_id", f"{exc}: such requests are served untraced")
            return False
        return True

    def _untraced(self, reason: str, message: str) -> None:
        """Count something served untraced; say why once."""
        if self._sender.untraced(reason):
            log.warning("attention tap on %s: %s (counted in tap.counts.untraced[%r])", self._contract.model_id,
                        message, reason)

    def _expand(self, item: Any) -> list[tuple[Any, ...]]:
        return item.traces(self._templates) if isinstance(item, Stream) else self._traces(item)

    def _remember_padding(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Before each forward of a sampled request: which keys are real tokens, as a 2-D
        mask of every key so far. ``generate`` passes the 2-D mask itself, except with a
        static cache, where it passes prepared 4-D masks: then the left padding is read
        from the prompt's ``position_ids`` (padding and the first token are both 0) and
        the keys so far from the cache."""
        state = _ACTIVE.get()
        if state is None or state.tap is not self or not any(state.sampled):
            return
        try:
            arguments = self._forward.bind_partial(*args, **kwargs).arguments
        except TypeError:
            arguments = kwargs
        cache = arguments.get("cache", arguments.get("past_key_values"))
        seen = getattr(cache, "get_seq_length", None)
        cached = int(seen(0)) if callable(seen) else None
        state.cached = cached
        mask = arguments.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2:
            state.padding = mask.detach()
            return
        tokens = arguments.get("input_ids", arguments.get("inputs_embeds"))
        if not isinstance(tokens, torch.Tensor):
            return
        batch, q_len = tokens.shape[0], tokens.shape[1]
        cached = cached or 0
        positions = arguments.get("position_ids")
        if q_len > 1 and isinstance(positions, torch.Tensor) and positions.shape == (batch, q_len):
            state.left = (q_len - positions.detach().max(dim=1).values - 1).clamp(min=0)
        left = state.left if state.left is not None else torch.zeros(batch, dtype=torch.long)
        keys = torch.arange(cached + q_len, device=left.device)
        state.padding = (keys[None, :] >= left[:, None]).long()

    @property
    def attached(self) -> bool:
        return self.installed

    def around(self, module: Any, output: Any, query: torch.Tensor, key: torch.Tensor,
               attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> Any:
        if self._batching.active():
            try:
                self._batching.around(module, query, key, kwargs)
            except Exception as exc:  # the tap never breaks the forward pass
                self._sender.failed()
                log.warning("attention tap: capturing failed: %s: %s", type(exc).__name__, exc)
            return output
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
        if layer not in self.layers or heads % max(key.shape[1], 1):
            return
        if batch != len(state.request_ids):
            if batch % len(state.request_ids) == 0:
                raise ValueError(f"{batch} sequences for {len(state.request_ids)} request ids: beam search and "
                                 "num_return_sequences > 1 are not traced (use greedy or sampled generation, one "
                                 "sequence a request)")
            raise ValueError(f"{batch} sequences in the batch but {len(state.request_ids)} request ids")
        scaling = float(kwargs.get("scaling") or query.shape[-1] ** -0.5)
        is_causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
        sinks = learned_sinks(module)
        captured = state.captures.get(layer)
        if captured is None:
            if q_len < 2:
                return  # a decoding step of a request whose prompt was not traced here
            # query i is key offset + i: after what the cache held (a static cache holds
            # more keys than are filled)
            offset = state.cached if state.cached is not None and state.cached + q_len <= k_len else k_len - q_len
            plan = self._plan(state, k_len, offset, key.device)
            if plan is None:
                return
            with torch.no_grad():
                weights, sink = row_weights(query, key, plan.sequences, plan.rows, plan.real, offset, scaling, mask,
                                            kwargs, is_causal, sinks)
            state.captures[layer] = _Capture(state, plan, layer, weights.to(torch.float16).cpu().numpy(),
                                             None if sink is None else sink.to(torch.float16).cpu().numpy(),
                                             DecodeRows(self.decode_rows))
            return
        if q_len != 1 or not self.decode_rows:
            return  # another forward of a traced layer: one prompt pass per request
        decode, index = captured.decode, captured.decode.steps

        def recompute() -> Step:
            return self._decode_step(state, captured, index, query, key, mask, kwargs, scaling, is_causal, sinks)

        if decode.keeps(index):
            decode.offer(recompute())
        else:
            decode.hold(index, recompute)

    def _decode_step(self, state: _Request, captured: _Capture, index: int, query: torch.Tensor, key: torch.Tensor,
                     mask: torch.Tensor | None, kwargs: dict[str, Any], scaling: float, is_causal: bool,
                     sinks: torch.Tensor | None) -> Step:
        """One decoding step's row of each traced sequence, over the keys so far."""
        plan = captured.plan
        k_len, heads = key.shape[2], query.shape[1]
        # the cache may not start at the sequence's first key (a sliding-window layer's
        # keeps the last window), nor end at the query (a static cache is longer): the
        # query's own key is the last its mask shows, and its absolute position the
        # length of the 2-D mask the model was called with
        own = _own_position(mask, k_len)
        absolute = own if state.padding is None else int(state.padding.shape[-1]) - 1
        shift = absolute - own
        real = _real_keys(state.padding, plan.sequences, absolute + 1, key.device)
        cached = torch.zeros(len(plan.counts), k_len, dtype=torch.bool, device=key.device)
        cached[:, : own + 1] = real[:, shift : shift + own + 1]
        rows = torch.full((len(plan.counts), 1), own, dtype=torch.long, device=key.device)
        with torch.no_grad():
            weights, sink = row_weights(query, key, plan.sequences, rows, cached, own, scaling, mask, kwargs,
                                        is_causal, sinks)
        row = np.zeros((len(plan.counts), heads, absolute + 1), np.float16)
        row[:, :, shift : shift + own + 1] = weights[:, :, 0, : own + 1].to(torch.float16).cpu().numpy()
        captured.real = real.cpu().numpy()
        return Step(index, absolute, absolute + 1, row,
                    None if sink is None else sink[:, :, 0].to(torch.float16).cpu().numpy())

    def _plan(self, state: _Request, k_len: int, offset: int, device: torch.device) -> _Plan | None:
        """The request's plan for ``k_len`` keys (made at its first traced layer): real
        keys from the model's 2-D mask, and ``rows`` real query positions per sequence,
        reproducible from the request id and the seed."""
        if (k_len, offset) in state.plans:
            return state.plans[(k_len, offset)]
        padding = state.padding
        if padding is not None and padding.shape[-1] <= k_len:  # keys beyond it (a static cache's) are not real
            real = torch.zeros(len(state.request_ids), k_len, dtype=torch.bool, device=device)
            real[:, : padding.shape[-1]] = padding.to(device) != 0
        else:
            real = torch.ones(len(state.request_ids), k_len, dtype=torch.bool, device=device)
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
        seeds = np.array([row_seed(self.seed, state.request_ids[b]) for b in chosen], dtype=np.uint64)
        ranks = np.where(queries, rank(among_real.astype(np.uint64), seeds[:, None]), np.iinfo(np.uint64).max)
        picked = np.argsort(ranks, axis=1, kind="stable")[:, : self.rows]  # key positions, best ranked first
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

    def _traces(self, capture: _Capture) -> list[tuple[Any, ...]]:
        """Header, weights (and the learned sink's mass) of each sequence of a capture,
        on the sender thread: its prompt rows, then its decoding steps', each over the
        sequence's real keys as of the last step (a row sees none of the keys after it)."""
        plan, request = capture.plan, capture.request
        template = self._templates[capture.layer]
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


def _own_position(mask: torch.Tensor | None, k_len: int) -> int:
    """The key position of a decoding step's query (one token): the last key its mask
    shows (a static cache holds more keys than are filled), or the newest key."""
    if mask is None or mask.ndim < 4:
        return k_len - 1
    row = mask[0, 0, -1]
    visible = row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2
    shown = torch.nonzero(visible)
    return int(shown.max()) if len(shown) else k_len - 1


def _real_keys(padding: torch.Tensor | None, sequences: torch.Tensor, k_len: int,
               device: torch.device) -> torch.Tensor:
    """``[S, k_len]``: the traced sequences' real (not padding) keys, from the 2-D mask the
    model was last called with (keys beyond it, in a static cache, are not real)."""
    real = torch.zeros(len(sequences), k_len, dtype=torch.bool, device=device)
    if padding is None:
        real[:] = True
        return real
    known = min(padding.shape[-1], k_len)
    real[:, :known] = padding.to(device)[sequences, :known] != 0
    return real


def _sink_layers(model: Any) -> frozenset[int] | None:
    """The layers whose attention modules have learned sink logits (gpt-oss's ``sinks``)."""
    found = {int(m.layer_idx) for m in model.modules()
             if learned_sinks(m) is not None and isinstance(getattr(m, "layer_idx", None), int)}
    return frozenset(found) or None


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
           queue_size: int = 1024, decode_rows: int = 4) -> AttentionTap:
    """Tap ``model``'s attention; traces of sampled requests go to ``sink`` (a
    :class:`~monitor.producer.TraceProducer`, or any callable taking a header and the
    weights, and the learned sink's mass when the layer has one). ``rows``: prompt rows
    per trace; ``decode_rows``: decoding steps per trace during ``generate``, spread over
    the generation, plus the last (0: none). ``model_id`` defaults to the config's name
    or path, ``revision`` to the checkpoint's as ``contract derive`` names it when the
    model holds the weights of the safetensors checkpoint it was loaded from (in any
    dtype), else a content hash of the loaded weights (:func:`model_revision`), ``scope`` to tenant
    ``default`` / data class ``internal``, ``producer_id`` to this host's name."""
    return AttentionTap(model, sink, rows=rows, sample_rate=sample_rate, layers=layers, seed=seed,
                        model_id=model_id, revision=revision,
                        scope=scope or Scope(tenant="default", data_class="internal"),
                        producer_id=producer_id or socket.gethostname()[:128], queue_size=queue_size,
                        decode_rows=decode_rows)
