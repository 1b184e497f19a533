"""The tap inside transformers' continuous batching: requests that join and leave a running
batch, prompts prefilled in chunks, keys in a paged cache.

Under continuous batching the model's forward pass gets one packed sequence: the query
tokens of every request of the batch one after the other (``cu_seq_lens_q``), keys per
request from the paged cache, and the cache object itself (``cache``). Which request is
which slice, and at which positions, is known to the manager's batch processor. Before
each forward pass the tap finds that processor and reads its batch, checked against the
pass (:mod:`~monitor.integrations.batch_processor`); no manager needs to be handed to
the tap, and one started before :func:`attach` is traced as well.

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
its prompt rows are all there, else counted as untraced. What cannot be read (a batch
processor of another layout, a batch that does not match its pass, a graph being
captured) is served untraced, counted by reason and said once.

Several returned sequences (``num_return_sequences = n``): the engine prefills a request's
prompt but its last token, then forks it into ``n − 1`` children ``<id>__child#<i>``
sharing its cached keys. A child follows its parent: traced when the parent is sampled,
under ``<traced id>__child-<i>`` (``#`` is no request-id character; an id given to
:meth:`ContinuousBatching.identify` for the child's engine id wins), with the parent's
prompt rows and its own decoding steps. So a sampled request gives one trace per returned
sequence and layer, an unsampled one none.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transformers
from numpy.typing import NDArray
from transformers.generation.continuous_batching.cache import PagedAttentionCache

from monitor.integrations.batch_processor import (
    WRITTEN_FOR,
    Member,
    ProcessorLookup,
    Unreadable,
    batch_members,
    batch_requests,
    check_against_pass,
    present,
)
from monitor.integrations.decoding import DecodeRows, Step
from monitor.integrations.paged_recompute import on_device, paged_rows, rows_over_keys
from monitor.integrations.recompute import learned_sinks
from monitor.integrations.row_sampling import pick_positions
from monitor.integrations.traced_request import LayerRows, Stream
from monitor.protocol.schema import Scope

log = logging.getLogger(__name__)
_DECIDED = 65_536  #: request ids whose sampling decision is remembered
_CHILD = re.compile(r"^(?P<parent>.+)__child#(?P<index>[0-9]+)$")  #: a forked returned sequence's engine id


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
        self._lookup = ProcessorLookup()
        self._routers: dict[int, tuple[Any, Callable[..., Any], Callable[..., Any]]] = {}

    # --- the model owner's verbs ----------------------------------------------------------

    def watch(self, model: Any) -> None:
        """Remember the managers ``model`` makes from now on (where their processors are)."""
        self._lookup.watch(model)

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
                if everything or processor is None or not present(processor, stream.engine_id):
                    self._finish(stream.engine_id, "cancelled")

    def close(self) -> None:
        self._lookup.close()
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
        device = cache.device
        if (device.type if isinstance(device, torch.device) else torch.device(device).type) == "cuda" and \
                torch.cuda.is_current_stream_capturing():
            self._untraced("accelerator_graph", "continuous batching under CUDA graphs: captured passes are replayed "
                           "without Python, so nothing is traced (disable use_cuda_graph to trace)")
            return True
        try:
            processor = self._lookup.find(cache)
            self._watch(processor)
            if self._nothing_to_trace(processor):
                return True
            members = batch_members(processor)
        except Unreadable as exc:
            self._untraced("continuous_batching_unreadable", str(exc))
            return True
        entries: list[_Entry] = []
        traced: list[Member] = []
        with self._lock:
            for index, member in enumerate(members):
                stream = self._streams.get(member.state.request_id) or self._open(member.state, member.past,
                                                                                  processor)
                if stream is not None:
                    positions = self._positions(stream, member.past, member.length)
                    if positions:
                        entries.append(_Entry(stream, index, member.start, member.past, member.length, positions))
                        traced.append(member)
            for stream in list(self._streams.values()):  # cancelled since the last pass
                if stream.processor() is processor and not present(processor, stream.engine_id):
                    self._finish(stream.engine_id, "cancelled")
        if entries:
            try:
                check_against_pass(members, traced, kwargs)
            except Unreadable as exc:
                self._refuse(entries, str(exc))
                return True
        self._local.batch = _Batch(cache, tuple(entries)) if entries else None
        return True

    def _nothing_to_trace(self, processor: Any) -> bool:
        """Whether the pass has nothing for the tap, told from the batch's request ids alone:
        no stream is open (none to trace, none cancelled) and every request of the batch was
        already decided unsampled. The common pass at a low sample rate then costs one
        dictionary look-up per request; a request seen for the first time, or anything the
        read does not expect, leaves the pass to the full read, which decides and checks."""
        if self._streams:
            return False
        decided = self._decided
        try:
            for entry in batch_requests(processor):
                if decided.get(entry.state.request_id) is not False:
                    return False
        except (AttributeError, TypeError):
            return False
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
        try:
            self._around(batch, layer, module, query, key, kwargs)
        except AttributeError as exc:  # the paged cache is laid out otherwise
            self._local.batch = None
            missing = exc.name or "attribute"
            self._refuse(batch.entries, f"transformers {transformers.__version__}'s paged cache has no {missing} "
                         f"({exc}); the tap reads the layout of transformers {WRITTEN_FOR}, so the pass is served "
                         "untraced")

    def _around(self, batch: _Batch, layer: int, module: Any, query: torch.Tensor, key: torch.Tensor,
                kwargs: dict[str, Any]) -> None:
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

    def _refuse(self, entries: Sequence[_Entry], message: str) -> None:
        """A pass whose batch or cache could not be read right: its traced requests are
        never published (what was read of them cannot be trusted) nor reopened."""
        self._untraced("continuous_batching_unreadable", message)
        with self._lock:
            for entry in entries:
                entry.stream.closed = True
                self._streams.pop(entry.stream.engine_id, None)
                self._decide(entry.stream.engine_id, False)

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
        named = self._names.pop(engine_id, None)
        fork = _CHILD.match(engine_id)
        if fork is not None and decided is None and fork["parent"] in self._decided:
            return self._fork(engine_id, fork["parent"], int(fork["index"]), named, processor)
        request_id, scope = named or (f"{fork['parent']}__child-{fork['index']}" if fork else engine_id, None)
        if decided is None:
            decided = self._decide(engine_id, self._traceable(request_id) and self._sampled(request_id))
            if not decided:
                return None
        prompt = int(getattr(state, "_true_initial_tokens", 0) or len(state.initial_tokens))
        rows = pick_positions(past, prompt, self.rows, self._row_seed(request_id))
        stream = Stream(engine_id, request_id, scope or self.scope, time.time(), prompt, rows,
                        weakref.ref(processor), self.decode_rows)
        self._streams[engine_id] = stream
        return stream

    def _fork(self, engine_id: str, parent_id: str, index: int, named: tuple[str, Scope | None] | None,
              processor: Any) -> Stream | None:
        """A returned sequence the engine forked from a request it serves: traced when its
        parent is, with the parent's plan and prompt rows (its cached keys are the parent's)."""
        parent = self._streams.get(parent_id)
        if not self._decided[parent_id] or parent is None:
            if self._decided[parent_id]:  # the parent's trace is gone (it finished or was cancelled)
                self._untraced("returned_sequence", "a returned sequence forked after its request's trace was "
                               "published is not traced")
            self._decide(engine_id, False)
            return None
        request_id = named[0] if named else f"{parent.request_id}__child-{index}"
        if not self._decide(engine_id, self._traceable(request_id)):
            return None
        stream = Stream(engine_id, request_id, (named[1] if named else None) or parent.scope, parent.timestamp,
                        parent.prompt_length, parent.rows, weakref.ref(processor), self.decode_rows)
        stream.layers = {number: LayerRows(dict(rows.prompt), DecodeRows(self.decode_rows))
                         for number, rows in parent.layers.items()}
        self._streams[engine_id] = stream
        return stream

    def _decide(self, engine_id: str, decided: bool) -> bool:
        self._decided[engine_id] = decided
        while len(self._decided) > _DECIDED:
            self._decided.popitem(last=False)
        return decided

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

    def _keep(self, stream: Stream, rows: LayerRows, positions: list[int], weights: NDArray[np.float16],
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

