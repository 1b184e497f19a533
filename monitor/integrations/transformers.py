"""An attention tap for transformers models: traces from a live model, whatever attention
implementation it runs (sdpa, eager, flash), without changing its outputs, whether the
caller runs the model itself or transformers' continuous batching serves it.

::

    from monitor.integrations.transformers import attach
    from monitor.producer import TraceProducer

    producer = TraceProducer(bootstrap_servers=..., key_id="team-a", secret=...)
    tap = attach(model, producer, sample_rate=0.01, scope=Scope(tenant="team-a", data_class="internal"))
    producer.publish_contract(tap.contract())
    with tap.request(request_id):              # one id, or one per sequence of a batch
        outputs = model(**inputs)               # or model.generate(...)
    results = model.generate_batch(prompts)     # continuous batching: traced under its request ids
    tap.detach()                              # publishes, flushes; the model's attention unwrapped

How it works. :func:`attach` wraps the model's attention without renaming its
implementation (:class:`~monitor.integrations.attention_wrapper.AttentionWrapper`): the
implementation runs unchanged and its output is returned as is. For sampled requests
only, the wrapper then recomputes the attention weights of ``rows`` sampled query rows
per head from the query and key states it received (after RoPE; GQA/MQA by grouping),
with the model's scaling, its mask (causal, padding, sliding window), softcapping,
position bias and learned sinks (gpt-oss: each row's sink mass travels beside its
weights). Fused kernels never materialise the weights; these few rows cost ``rows ×
keys × head_dim`` per head.

Sampling is decided once per request from a hash of the request id and ``seed``:
reproducible, and the same across layers and paths. Forward passes the caller makes
inside ``tap.request`` (a plain call, ``generate``: chunked prefill, speculative
decoding, worker threads) are traced by :mod:`~monitor.integrations.generation`;
continuous batching (``generate_batch``, a manager from ``init_continuous_batching``,
``transformers serve --continuous-batching``) by :mod:`~monitor.integrations.
continuous_batching`, on the engine-neutral :mod:`~monitor.integrations.paged_recompute`.
A trace of a generation holds ``rows`` prompt rows and ``decode_rows`` decoding steps
spread over the generation plus the last (:mod:`~monitor.integrations.decoding`), each
at its own position; ``prompt_length`` says where the prompt ends. What the tap cannot
trace is served untraced, counted by reason (``tap.counts.untraced``) and said once in
the log. Traces go out through a bounded queue and a background thread
(:mod:`~monitor.integrations.sender`): the forward pass never waits.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.utils.generic import is_flash_attention_requested

from monitor.integrations.attention_wrapper import AttentionWrapper
from monitor.integrations.continuous_batching import ContinuousBatching
from monitor.integrations.generation import Generation
from monitor.integrations.hf_contract import contract_from_config, model_revision, weights_revision
from monitor.integrations.recompute import learned_sinks
from monitor.integrations.row_sampling import request_sampled, row_seed
from monitor.integrations.sender import Sender, TapCounts
from monitor.integrations.traced_request import Stream
from monitor.protocol.model_contract import ModelContract
from monitor.protocol.schema import Scope, TraceHeader, check_identifier

__all__ = ["AttentionTap", "TapCounts", "attach", "contract_from_config", "model_revision", "weights_revision"]

log = logging.getLogger(__name__)
Sink = Callable[..., Any]  #: (header, weights[, sink mass]) -> anything


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
        self._batching.watch(model)
        self._generation = Generation(model, rows=rows, decode_rows=decode_rows, layers=self.layers, seed=seed,
                                      sampled=self.sampled, sender=self._sender, untraced=self._untraced,
                                      layer_of=self.layer, templates=self._templates)
        #: the current thread's forward pass: ``unknown``, whether it runs an unknown kernel;
        #: ``idle``, whether its attention calls have nothing to trace (an unknown kernel, or a
        #: continuous-batching pass without a traced request), the one flag every layer reads first
        self._pass = threading.local()
        self._hook = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        self._after = model.register_forward_hook(self._after_forward)
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

    def request(self, request_id: str | Sequence[str], *,
                scope: Scope | None = None) -> contextlib.AbstractContextManager[None]:
        """Tag the forward passes inside the block (a call, ``generate``) with the request id
        (or one id per sequence of a batched input, in batch order). Its traces are
        published when the block ends (and the calls carried out of it have returned)."""
        return self._generation.request(request_id, scope or self.scope)

    def untraced(self) -> contextlib.AbstractContextManager[None]:
        """Forward passes inside belong to a request the caller serves untraced on purpose
        and counts itself (one without a usable id): nothing is traced, and they are not
        counted as ``outside_request``."""
        return self._generation.untraced(self.scope)

    def carry(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` bound to the open ``tap.request`` block, to run on another thread:
        ``threading.Thread(target=tap.carry(model.generate), kwargs=...)`` (the streamer
        pattern), ``loop.run_in_executor(None, tap.carry(partial(model.generate, ...)))``.
        A context variable does not follow a call onto another thread by itself
        (``asyncio.to_thread`` is the exception: it copies the context). Call the result
        once; the request's traces wait for it to return."""
        return self._generation.carry(function)

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
            self._generation.close()
            self._sender.close(timeout)
            log.info("attention tap detached from %s: %s", self._contract.model_id, self.counts.line())
        return self.counts

    # --- inside the forward pass ---------------------------------------------------------

    def _before_forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        implementation = getattr(self.model.config, "_attn_implementation", None)
        self._pass.unknown = self._pass.idle = not _known_kernel(implementation)
        if self._pass.unknown:
            self._batching.after_forward()
            self._untraced("unknown_kernel", f"the attention implementation {implementation!r} is not one whose "
                           "rows the tap knows how to recompute (eager, sdpa, paged|eager, flash): forward passes "
                           "under it are served untraced")
            return
        try:
            if self._batching.before_forward(kwargs):
                self._pass.idle = not self._batching.active()
                return
            self._generation.before_forward(args, kwargs)
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
        return item.traces(self._templates) if isinstance(item, Stream) else self._generation.traces(item)

    @property
    def attached(self) -> bool:
        return self.installed

    def _after_forward(self, *_: Any) -> None:
        self._batching.after_forward()
        self._pass.idle = getattr(self._pass, "unknown", False)

    def around(self, module: Any, output: Any, query: torch.Tensor, key: torch.Tensor,
               attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> Any:
        if getattr(self._pass, "idle", False):
            return output
        if self._batching.active():
            try:
                self._batching.around(module, query, key, kwargs)
            except Exception as exc:  # the tap never breaks the forward pass
                self._sender.failed()
                log.warning("attention tap: capturing failed: %s: %s", type(exc).__name__, exc)
            return output
        try:
            self._generation.around(module, query, key, attention_mask, kwargs)
        except Exception as exc:  # the tap never breaks the forward pass
            self._sender.failed()
            log.warning("attention tap: capturing failed: %s: %s", type(exc).__name__, exc)
        return output

def _known_kernel(implementation: str | None) -> bool:
    """Whether the tap knows what an attention implementation computes (its rows are
    recomputed from the query, the keys and the mask or positions it gets)."""
    return implementation in (None, "eager", "sdpa", "paged|eager") or \
        is_flash_attention_requested(requested_attention_implementation=implementation)


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
