"""The tap inside transformers' continuous batching: requests that join and leave a running
batch, prompts prefilled in chunks, keys in a paged cache.

Under continuous batching the model's forward pass gets one packed sequence: the query
tokens of every request of the batch one after the other (``cu_seq_lens_q``), keys per
request from the paged cache, and the cache object itself (``cache``). Which request is
which slice, and at which positions, is known to the manager's batch processor: its
batch's request states in packing order, each with its query length and (already
advanced) position offset. Before each forward pass the tap finds that batch processor
(by looking up the calling frames once per cache) and reads the batch; no manager needs
to be handed to the tap, and one started before :func:`attach` is traced as well.

A sampled request becomes a :class:`Stream`, traced under the engine's request id, or
under the id :meth:`ContinuousBatching.identify` gave it (a server's completion id). Its
prompt rows are chosen once over the whole prompt (from the first position the request
computes: prefix sharing skips cached blocks), whatever chunks the prompt is prefilled
in; each row is recomputed in the pass that computes its query, at its own position:
from the paged cache through the request's block table for full-attention layers
(:mod:`~monitor.integrations.paged_recompute`), from the keys the layer was handed for
sliding-window layers (their ring buffer has already overwritten what a row of a long
chunk saw). Decoding steps are kept as in ``generate`` (:mod:`~monitor.integrations.
decoding`), each recomputed in its own pass. A request's traces are published once, when
the manager delivers its last output (the output router of the manager is wrapped for
that); a cancelled or failed request's traces are published with the rows it got, when
its prompt rows are all there, else counted as untraced. What cannot be read (an
unrecognised batch processor, a graph being captured) is served untraced and counted.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

from monitor.integrations.decoding import DecodeRows, Step
from monitor.integrations.paged_recompute import on_device, paged_rows, rows_over_keys
from monitor.integrations.recompute import learned_sinks
from monitor.integrations.row_sampling import pick_positions
from monitor.protocol.schema import Scope, TraceHeader

log = logging.getLogger(__name__)
_DECIDED = 65_536  #: request ids whose sampling decision is remembered


@dataclass
class _LayerRows:
    prompt: dict[int, tuple[NDArray[np.float16], NDArray[np.float16] | None]]  #: position → [H, position+1], [H]
    decode: DecodeRows


@dataclass
class Stream:
    """One traced request of a continuous-batching manager, across the passes serving it."""

    engine_id: str
    request_id: str
    scope: Scope
    timestamp: float
    prompt_length: int
    rows: tuple[int, ...]  #: the prompt positions traced
    processor: weakref.ref[Any]
    decode_rows: int
    layers: dict[int, _LayerRows] = field(default_factory=dict)
    closed: bool = False

    def layer(self, number: int) -> _LayerRows:
        found = self.layers.get(number)
        if found is None:
            found = self.layers[number] = _LayerRows({}, DecodeRows(self.decode_rows))
        return found

    def complete(self) -> bool:
        """Whether every traced layer has all its prompt rows."""
        return bool(self.layers) and all(len(rows.prompt) == len(self.rows) for rows in self.layers.values())

    def traces(self, templates: dict[int, TraceHeader]) -> list[tuple[Any, ...]]:
        """Header, weights ``[H, rows, keys]`` (and the learned sink's mass) of each layer:
        the prompt rows, then the decoding steps kept, over every key up to the last row."""
        out: list[tuple[Any, ...]] = []
        for number, rows in sorted(self.layers.items()):
            steps = rows.decode.chosen()
            prompt = sorted(rows.prompt)
            if not prompt and not steps:
                continue
            keys = steps[-1].keys if steps else self.prompt_length
            heads = (rows.prompt[prompt[0]][0] if prompt else steps[0].weights[0]).shape[0]
            weights = np.zeros((heads, len(prompt) + len(steps), keys), np.float16)
            sinks: list[NDArray[np.float16] | None] = []
            for r, position in enumerate(prompt):
                row, sink = rows.prompt[position]
                weights[:, r, : row.shape[-1]] = row
                sinks.append(sink)
            for r, step in enumerate(steps, start=len(prompt)):
                weights[:, r, : step.keys] = step.weights[0]
                sinks.append(None if step.sink is None else step.sink[0])
            extra = {"prompt_length": self.prompt_length} if steps else {}
            header = templates[number].model_copy(update={
                "trace_id": f"{self.request_id}/{number}/{uuid.uuid4().hex[:12]}" if len(self.request_id) <= 100
                else uuid.uuid4().hex,
                "request_id": self.request_id, "query_positions": (*prompt, *(s.position for s in steps)),
                "key_count": keys, "scope": self.scope, "timestamp": self.timestamp, **extra})
            if any(s is None for s in sinks):
                out.append((header, weights))
            else:
                out.append((header, weights, np.stack([s for s in sinks if s is not None], axis=-1)))
        return out


@dataclass(frozen=True)
class _Entry:
    """A traced request's part of one packed batch."""

    stream: Stream
    index: int  #: its place in the batch (``cu_seq_lens``)
    start: int  #: its first query token in the packed batch
    past: int  #: the position of that token
    length: int  #: its query tokens
    positions: tuple[int, ...]  #: the positions to trace in this pass (prompt rows, decoding steps)


@dataclass(frozen=True)
class _Batch:
    cache: Any
    entries: tuple[_Entry, ...]


class ContinuousBatching:
    """The continuous-batching side of one :class:`~monitor.integrations.transformers.AttentionTap`."""

    def __init__(self, *, rows: int, decode_rows: int, layers: frozenset[int], scope: Scope,
                 sampled: Callable[[str], bool], row_seed: Callable[[str], int], traceable: Callable[[str], bool],
                 publish: Callable[[Stream], object], untraced: Callable[[str, str], None],
                 layer_of: Callable[[Any], int]):
        self.rows, self.decode_rows, self.layers, self.scope = rows, decode_rows, layers, scope
        self._sampled, self._row_seed, self._traceable = sampled, row_seed, traceable
        self._publish, self._untraced, self._layer_of = publish, untraced, layer_of
        self._lock = threading.RLock()
        self._local = threading.local()
        self._streams: dict[str, Stream] = {}
        self._decided: OrderedDict[str, bool] = OrderedDict()
        self._names: OrderedDict[str, tuple[str, Scope | None]] = OrderedDict()
        self._processors: dict[int, weakref.ref[Any]] = {}  #: id(cache) → its batch processor
        self._routers: dict[int, tuple[Any, Callable[..., Any], Callable[..., Any]]] = {}

    # --- the model owner's verbs ----------------------------------------------------------

    def identify(self, engine_id: str, request_id: str, scope: Scope | None) -> None:
        with self._lock:
            self._names[engine_id] = (request_id, scope)
            self._names.move_to_end(engine_id)
            while len(self._names) > _DECIDED:
                self._names.popitem(last=False)

    def sweep(self, everything: bool = False) -> None:
        """Publish the streams whose requests left their manager (cancelled, or stopped
        with it); with ``everything``, every open stream (the tap is detaching)."""
        with self._lock:
            for stream in list(self._streams.values()):
                processor = stream.processor()
                if everything or processor is None or not _present(processor, stream.engine_id):
                    self._finish(stream.engine_id, "cancelled")

    def close(self) -> None:
        self.sweep(everything=True)
        with self._lock:
            for router, deliver_batch, deliver in self._routers.values():
                if router.__dict__.get("deliver_batch") is deliver_batch:
                    del router.deliver_batch
                if router.__dict__.get("deliver") is deliver:
                    del router.deliver
            self._routers.clear()

    # --- before and inside the forward pass -------------------------------------------------

    def before_forward(self, kwargs: dict[str, Any]) -> bool:
        """Read the batch of a continuous-batching pass; False when it is not one."""
        cache = kwargs.get("cache")
        if not isinstance(cache, PagedAttentionCache):
            return False
        self._local.batch = None
        if torch.device(cache.device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            self._untraced("accelerator_graph", "continuous batching under CUDA graphs: captured passes are replayed "
                           "without Python, so nothing is traced (disable use_cuda_graph to trace)")
            return True
        processor = self._processor(cache)
        if processor is None:
            self._untraced("continuous_batching_unreadable", "the continuous-batching pass came from no batch "
                           "processor the tap recognises: served untraced")
            return True
        self._watch(processor)
        entries = []
        start = 0
        with self._lock:
            for index, future in enumerate(_batch_requests(processor)):
                state, length = future.state, int(future.query_length)
                past = int(state.position_offset) - length
                stream = self._streams.get(state.request_id) or self._open(state, past, processor)
                if stream is not None:
                    positions = self._positions(stream, past, length)
                    if positions:
                        entries.append(_Entry(stream, index, start, past, length, positions))
                start += length
            for stream in list(self._streams.values()):  # cancelled since the last pass
                if stream.processor() is processor and not _present(processor, stream.engine_id):
                    self._finish(stream.engine_id, "cancelled")
        self._local.batch = _Batch(cache, tuple(entries)) if entries else None
        return True

    def after_forward(self) -> None:
        self._local.batch = None

    def active(self) -> bool:
        """Whether the current thread is in a continuous-batching pass with traced requests."""
        return getattr(self._local, "batch", None) is not None

    def around(self, module: Any, query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any]) -> None:
        batch: _Batch | None = getattr(self._local, "batch", None)
        if batch is None:
            return
        layer = self._layer_of(module)
        if layer not in self.layers:
            return
        allocator = batch.cache.layer_to_allocator.get(layer)
        window = getattr(allocator, "sliding_window", None) if getattr(allocator, "layer_type", "") == \
            "sliding_attention" else None
        scaling = float(kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5)
        softcap = kwargs.get("softcap") or None
        sinks = learned_sinks(module)
        with self._lock, torch.no_grad():
            for entry in batch.entries:
                if entry.stream.closed:
                    continue
                rows = entry.stream.layer(layer)
                wanted = [p for p in entry.positions if p not in rows.prompt and
                          (p < entry.stream.prompt_length or p - entry.stream.prompt_length >= rows.decode.steps)]
                if not wanted:
                    continue
                # host positions: what is read from the cache follows from them without a device read back
                q = query[0][:, on_device([entry.start + p - entry.past for p in wanted], query.device)]  # [H, R, d]
                if window:
                    weights, sink = self._from_keys(entry, q, wanted, key, kwargs, scaling, window, softcap, sinks)
                else:
                    weights, sink = self._from_cache(entry, q, wanted, batch.cache, allocator, layer, kwargs,
                                                     scaling, softcap, sinks)
                self._keep(entry.stream, rows, wanted, weights.to(torch.float16).cpu().numpy(),
                           None if sink is None else sink.to(torch.float16).cpu().numpy())

    # --- the pieces ----------------------------------------------------------------------------

    def _processor(self, cache: Any) -> Any:
        """The batch processor whose cache this is: remembered, else found among the
        calling frames (the pass runs inside its generation step)."""
        found = self._processors.get(id(cache))
        processor = found() if found is not None else None
        if processor is not None and processor.cache is cache:
            return processor
        frame = sys._getframe(2)
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, ContinuousBatchProcessor) and candidate.cache is cache:
                self._processors[id(cache)] = weakref.ref(candidate)
                return candidate
            frame = frame.f_back  # type: ignore[assignment]
        return None

    def _watch(self, processor: Any) -> None:
        """Wrap the processor's output router once: a finished request's traces go out when
        its last output is delivered."""
        router = processor.output_router
        if id(router) in self._routers:
            return
        original_batch, original_one = router.deliver_batch, router.deliver

        def deliver_batch(outputs: list[Any]) -> None:
            original_batch(outputs)
            self._delivered(outputs)

        def deliver(output: Any) -> None:
            original_one(output)
            self._delivered([output])

        router.deliver_batch, router.deliver = deliver_batch, deliver
        self._routers[id(router)] = (router, deliver_batch, deliver)

    def _delivered(self, outputs: list[Any]) -> None:
        try:
            with self._lock:
                for output in outputs:
                    if output.is_finished():
                        self._decided.pop(output.request_id, None)
                        if output.request_id in self._streams:
                            self._finish(output.request_id, "failed" if output.error else "finished")
        except Exception as exc:  # the tap never breaks the manager
            log.warning("attention tap: publishing a finished request failed: %s: %s", type(exc).__name__, exc)

    def _open(self, state: Any, past: int, processor: Any) -> Stream | None:
        """A stream for a request seen for the first time, if it is traced."""
        engine_id = state.request_id
        decided = self._decided.get(engine_id)
        if decided is False:
            return None
        request_id, scope = self._names.pop(engine_id, (engine_id, None))
        if decided is None:
            decided = self._traceable(request_id) and self._sampled(request_id)
            self._decided[engine_id] = decided
            while len(self._decided) > _DECIDED:
                self._decided.popitem(last=False)
            if not decided:
                return None
        prompt = int(getattr(state, "_true_initial_tokens", 0) or len(state.initial_tokens))
        rows = pick_positions(past, prompt, self.rows, self._row_seed(request_id))
        stream = Stream(engine_id, request_id, scope or self.scope, time.time(), prompt, rows,
                        weakref.ref(processor), self.decode_rows)
        self._streams[engine_id] = stream
        return stream

    @staticmethod
    def _positions(stream: Stream, past: int, length: int) -> tuple[int, ...]:
        """The positions of a pass to trace: planned prompt rows, and every decoding step."""
        end = past + length
        prompt = [p for p in stream.rows if past <= p < end]
        return (*prompt, *range(max(past, stream.prompt_length), end))

    def _from_cache(self, entry: _Entry, q: torch.Tensor, positions: list[int], cache: Any, allocator: Any,
                    layer: int, kwargs: dict[str, Any], scaling: float, softcap: float | None,
                    sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows of a full-attention layer from the paged cache, the current pass's keys
        already written: the kernel's block table (decode fast path), else the request's
        blocks in the allocator's layout (keys of every layer of the group and the values
        interleaved in a block, so a block's slots are ``block_physical_stride`` apart)."""
        block_table = kwargs.get("block_table")
        if isinstance(block_table, torch.Tensor) and isinstance(kwargs.get("k_cache"), torch.Tensor):
            return paged_rows(q, positions, kwargs["k_cache"], block_table[entry.index], allocator.tokens_per_page,
                              scaling, softcap=softcap, sinks=sinks)
        page = allocator.tokens_per_page
        group = allocator.cache_tensor.shape[-2:]
        flat = allocator.cache_tensor.reshape(-1, *group)
        keys = flat[2 * allocator.layer_indices.index(layer) * page:]
        return paged_rows(q, positions, keys, allocator.block_table[entry.stream.engine_id], page, scaling,
                          block_stride=allocator.block_physical_stride, softcap=softcap, sinks=sinks)

    @staticmethod
    def _from_keys(entry: _Entry, q: torch.Tensor, positions: list[int], key: torch.Tensor,
                   kwargs: dict[str, Any], scaling: float, window: int, softcap: float | None,
                   sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows of a sliding-window layer from the keys the layer was handed: the request's
        slice of the packed keys holds its last cached ones and then the pass's own."""
        bounds = kwargs["cu_seq_lens_k"]
        first, last = int(bounds[entry.index]), int(bounds[entry.index + 1])
        origin = entry.past + entry.length - (last - first)
        key_positions = torch.arange(origin, origin + last - first, device=key.device)
        weights, sink = rows_over_keys(q, positions, key[0][:, first:last], key_positions, scaling, window=window,
                                       softcap=softcap, sinks=sinks)
        return torch.nn.functional.pad(weights, (origin, 0)), sink

    def _keep(self, stream: Stream, rows: _LayerRows, positions: list[int], weights: NDArray[np.float16],
              sink: NDArray[np.float16] | None) -> None:
        for r, position in enumerate(positions):
            row = weights[:, r, : position + 1]
            mass = None if sink is None else sink[:, r]
            if position < stream.prompt_length:
                rows.prompt[position] = (row, mass)
                continue
            step = Step(position - stream.prompt_length, position, position + 1, row[None],
                        None if mass is None else mass[None])
            if rows.decode.keeps(step.index):
                rows.decode.offer(step)
            else:
                rows.decode.hold(step.index, lambda s=step: s)  # type: ignore[misc]

    def _finish(self, engine_id: str, how: str) -> None:
        stream = self._streams.pop(engine_id, None)
        if stream is None or stream.closed:
            return
        stream.closed = True
        for rows in stream.layers.values():
            rows.decode.finish()
        if not stream.complete():
            self._untraced(f"{how}_before_prompt", f"a request {how} before its prompt rows were computed is not "
                           "published")
            return
        self._publish(stream)


def _batch_requests(processor: Any) -> list[Any]:
    """The request states of the processor's current batch, in packing order."""
    ios = processor.inputs_and_outputs
    pairs = getattr(ios, "io_pairs", None)
    if pairs is not None:  # asynchronous batching: the pair of the batch being computed
        ios = pairs[ios.current_pair].host_io
    return list(ios.requests_in_batch)


def _present(processor: Any, engine_id: str) -> bool:
    scheduler = processor.scheduler
    return engine_id in scheduler.active_requests or engine_id in scheduler.waiting_requests
