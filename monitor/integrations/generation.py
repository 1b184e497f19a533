"""The tap on the forward passes a caller makes itself, inside ``tap.request(...)``: a
plain ``model(...)`` call or ``model.generate(...)``, batched with left padding, a dynamic
or a static cache.

The first pass of a sampled request fixes its plan: the sampled sequences of the batch,
their real (not padding) keys and ``rows`` sampled query rows each. Under ``generate``
(wrapped on the model instance while the tap is attached) the plan covers the whole
prompt, whatever chunks it is prefilled in (``prefill_chunk_size``): each row is
recomputed in the pass that computes its query, at its own position, and
``prompt_length`` is the whole prompt's. Decoding steps are kept as
:mod:`~monitor.integrations.decoding` says, each recomputed from the step's query and the
cache it saw. Speculative decoding (prompt lookup, a draft model) verifies several
proposed tokens per pass and rolls the cache back: its prompt rows are traced, its
decoding steps are not (counted, ``speculative_decoding``). Beam search and
``num_return_sequences > 1`` run more sequences than request ids: served untraced,
counted (``beam_search``).

``tap.request`` is a context variable: it does not follow a call onto another thread.
:meth:`Generation.carry` binds a function to the open request for a worker thread
(``threading.Thread``, ``loop.run_in_executor``); the request's traces are published when
its block has ended and every carried call has returned. Forward passes of the tapped
model outside any request are counted (``outside_request``) and said once.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from monitor.integrations.decoding import DecodeRows, Step
from monitor.integrations.generation_rows import Capture, Plan, capture_traces, make_plan
from monitor.integrations.recompute import learned_sinks, row_weights
from monitor.integrations.sender import Sender
from monitor.protocol.schema import Scope, TraceHeader, check_identifier


@dataclass
class _Request:
    """The request(s) of the forward passes inside one ``tap.request`` block."""

    owner: Generation
    request_ids: tuple[str, ...]  #: one per sequence of the batch
    sampled: tuple[bool, ...]
    scope: Scope
    timestamp: float
    padding: torch.Tensor | None = None  #: the 2-D attention mask the model was called with last (1 = token)
    left: torch.Tensor | None = None  #: [batch] left padding of the prompt, when no 2-D mask says it
    cached: int | None = None  #: keys in the cache before the current forward (None: no cache seen)
    plans: dict[tuple[int, int], Plan | None] = field(default_factory=dict)  #: (end, first) → plan
    captures: dict[int, Capture] = field(default_factory=dict)  #: layer → its prompt rows (and decode rows)
    prompt_length: int | None = None  #: the padded prompt's length, when ``generate`` said it
    prompt_mask: torch.Tensor | None = None  #: [batch, prompt_length] its real tokens (1)
    decoding: bool = True  #: whether decoding steps are traced (not under speculative decoding)
    refused: str | None = None  #: why nothing of the request is traced
    open: bool = True  #: its block has not ended
    carried: int = 0  #: carried calls not returned yet
    published: bool = False


_ACTIVE: contextvars.ContextVar[_Request | None] = contextvars.ContextVar("attention_tap_request", default=None)


class Generation:
    """The ``tap.request`` side of one :class:`~monitor.integrations.transformers.AttentionTap`."""

    def __init__(self, model: Any, *, rows: int, decode_rows: int, layers: frozenset[int], seed: int,
                 sampled: Callable[[str], bool], sender: Sender, untraced: Callable[[str, str], None],
                 layer_of: Callable[[Any], int], templates: dict[int, TraceHeader]):
        self.model, self.rows, self.decode_rows, self.layers, self.seed = model, rows, decode_rows, layers, seed
        self._sampled, self._sender, self._untraced, self._layer_of = sampled, sender, untraced, layer_of
        self._templates = templates
        self._forward = inspect.signature(model.forward)
        self._lock = threading.Lock()
        original = getattr(model, "generate", None)

        def generate(*args: Any, **kwargs: Any) -> Any:
            state = _ACTIVE.get()
            if state is not None and state.owner is self and any(state.sampled) and state.prompt_length is None:
                self._prepare(state, args, kwargs)
            return original(*args, **kwargs)  # type: ignore[misc]

        self._generate = generate
        if original is not None:  # encoders have no generate
            model.generate = generate

    def close(self) -> None:
        if self.model.__dict__.get("generate") is self._generate:
            del self.model.generate

    # --- the model owner's verbs ------------------------------------------------------------

    @contextlib.contextmanager
    def request(self, request_id: str | Sequence[str], scope: Scope) -> Iterator[None]:
        ids = (request_id,) if isinstance(request_id, str) else tuple(request_id)
        if not ids:
            raise ValueError("give at least one request id")
        for rid in ids:
            check_identifier(rid, "request id")
        state = _Request(self, ids, tuple(self._sampled(r) for r in ids), scope, time.time())
        token = _ACTIVE.set(state)
        try:
            yield
        finally:
            _ACTIVE.reset(token)
            with self._lock:
                state.open = False
            self._done(state)

    @contextlib.contextmanager
    def untraced(self, scope: Scope) -> Iterator[None]:
        """Forward passes inside are of a request its caller serves untraced on purpose
        (and counts itself): no trace, and not counted as ``outside_request``."""
        token = _ACTIVE.set(_Request(self, (), (), scope, time.time()))
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    def carry(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` bound to the open ``tap.request`` for another thread; call it once."""
        state = _ACTIVE.get()
        if state is None or state.owner is not self:
            raise RuntimeError("tap.carry(...) binds a call to the open tap.request(...) block of this tap: open "
                               "one first")
        context = contextvars.copy_context()
        with self._lock:
            state.carried += 1
        returned = False

        def carried(*args: Any, **kwargs: Any) -> Any:
            nonlocal returned
            try:
                return context.run(function, *args, **kwargs)
            finally:
                with self._lock:
                    if not returned:
                        returned, state.carried = True, state.carried - 1
                self._done(state)

        return carried

    def _done(self, state: _Request) -> None:
        """Publish a request's traces once its block has ended and its carried calls returned."""
        with self._lock:
            if state.open or state.carried or state.published:
                return
            state.published = True
        for capture in state.captures.values():
            try:
                capture.decode.finish()
            except Exception as exc:  # the tap never breaks the model's caller
                self._sender.failed(len(capture.plan.counts))
                self._untraced("capture_failed", f"the last decoding step failed: {type(exc).__name__}: {exc}")
                continue
            if not capture.filled.all():
                self._sender.failed(len(capture.plan.counts))
                continue
            self._sender.offer(capture, traces=len(capture.plan.counts))

    def _prepare(self, state: _Request, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """What a ``generate`` call says before it runs: its prompt, and whether its decoding
        can be traced."""
        config = kwargs.get("generation_config") or getattr(self.model, "generation_config", None)

        def setting(name: str) -> Any:
            return kwargs[name] if name in kwargs else getattr(config, name, None)

        sampled = sum(state.sampled)
        if (setting("num_beams") or 1) > 1 or (setting("num_return_sequences") or 1) > 1:
            state.refused = "beam_search"
            self._untraced("beam_search", "beam search and num_return_sequences > 1 run more sequences than request "
                           "ids: such requests are served untraced (greedy or sampled generation, one sequence a "
                           "request, is traced)")
            self._sender.untraced("beam_search", sampled - 1)
            return
        if kwargs.get("assistant_model") is not None or setting("prompt_lookup_num_tokens") or \
                setting("assistant_early_exit"):
            state.decoding = False
            self._untraced("speculative_decoding", "speculative decoding (prompt lookup, a draft model) verifies "
                           "proposed tokens in passes it then rolls back: the prompt rows of such requests are "
                           "traced, their decoding steps are not")
            self._sender.untraced("speculative_decoding", sampled - 1)
        prompt = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
        if not isinstance(prompt, torch.Tensor):
            prompt = kwargs.get("inputs_embeds")
        if not isinstance(prompt, torch.Tensor) or prompt.ndim < 2:
            return
        state.prompt_length = int(prompt.shape[1])
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2 and mask.shape[1] == state.prompt_length:
            state.prompt_mask = mask.detach()

    # --- inside the forward pass -----------------------------------------------------------

    def before_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state = _ACTIVE.get()
        if state is None or state.owner is not self:
            self._untraced("outside_request", "forward passes of the tapped model outside tap.request(...) are not "
                           "traced; on a worker thread (a streamer's, an executor's), run the call through "
                           "tap.carry(...) inside the request's block")
            return
        if any(state.sampled) and state.refused is None:
            self._remember_padding(state, args, kwargs)

    def around(self, module: Any, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
               kwargs: dict[str, Any]) -> None:
        state = _ACTIVE.get()
        if state is not None and state.owner is self and any(state.sampled) and state.refused is None:
            self._capture(state, module, query, key, mask, kwargs)

    def _remember_padding(self, state: _Request, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Before each forward of a sampled request: which keys are real tokens, as a 2-D
        mask of every key so far. ``generate`` passes the 2-D mask itself, except with a
        static cache, where it passes prepared 4-D masks: then the left padding is read
        from the prompt's ``position_ids`` (padding and the first token are both 0) and
        the keys so far from the cache."""
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

    def _capture(self, state: _Request, module: Any, query: torch.Tensor, key: torch.Tensor,
                 mask: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
        layer = self._layer_of(module)
        batch, heads, q_len, _ = query.shape
        k_len = key.shape[2]
        if layer not in self.layers or heads % max(key.shape[1], 1):
            return
        if batch != len(state.request_ids):
            if batch % len(state.request_ids) == 0:
                state.refused = "beam_search"
                self._untraced("beam_search", f"{batch} sequences for {len(state.request_ids)} request ids: beam "
                               "search and num_return_sequences > 1 are not traced (use greedy or sampled generation, "
                               "one sequence a request)")
                self._sender.untraced("beam_search", sum(state.sampled) - 1)
                return
            raise ValueError(f"{batch} sequences in the batch but {len(state.request_ids)} request ids")
        scaling = float(kwargs.get("scaling") or query.shape[-1] ** -0.5)
        is_causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
        sinks = learned_sinks(module)
        captured = state.captures.get(layer)
        # the pass's keys start at absolute position ``shift`` (a sliding-window cache keeps
        # the last window) and its query i is key ``cached + i`` (a static cache holds more
        # keys than are filled)
        cached = state.cached if state.cached is not None else k_len - q_len
        shift = max(0, cached + q_len - k_len)
        prompt_end = state.prompt_length
        prompt_pass = cached < prompt_end if prompt_end is not None else captured is None
        if prompt_pass:
            if captured is None:
                if q_len < 2 and prompt_end is None:
                    return  # a decoding step of a request whose prompt was not traced here
                plan = self._plan(state, prompt_end or cached + q_len, cached, key.device)
                if plan is None:
                    return
                size, count, end = len(plan.counts), plan.rows.shape[1], plan.real.shape[1]
                captured = state.captures[layer] = Capture(
                    state, plan, layer, np.zeros((size, query.shape[1], count, end), np.float16),
                    None if sinks is None else np.zeros((size, query.shape[1], count), np.float16),
                    DecodeRows(self.decode_rows), np.zeros((size, count), bool))
            if not captured.filled.all():
                self._prompt_rows(captured, cached, shift, query, key, mask, kwargs, scaling, is_causal, sinks)
            return
        if captured is None:
            return
        if q_len != 1 or not self.decode_rows or not state.decoding:
            return  # another pass of a traced layer: speculative steps, or a second prompt
        decode, index = captured.decode, captured.decode.steps

        def recompute() -> Step:
            return self._decode_step(state, captured, index, query, key, mask, kwargs, scaling, is_causal, sinks)

        if decode.keeps(index):
            decode.offer(recompute())
        else:
            decode.hold(index, recompute)

    @staticmethod
    def _prompt_rows(captured: Capture, cached: int, shift: int, query: torch.Tensor, key: torch.Tensor,
                     mask: torch.Tensor | None, kwargs: dict[str, Any], scaling: float, is_causal: bool,
                     sinks: torch.Tensor | None) -> None:
        """The plan's prompt rows whose queries this pass computes (positions ``cached …
        cached + q_len − 1``), over the pass's keys (absolute ``shift …``)."""
        plan, q_len, k_len = captured.plan, query.shape[2], key.shape[2]
        inside = (plan.rows >= cached) & (plan.rows < cached + q_len)  # [S, R]
        if not bool(inside.any()):
            return
        rows = plan.rows.clamp(cached, cached + q_len - 1) - shift
        end = plan.real.shape[1]
        real = torch.zeros(len(plan.counts), k_len, dtype=torch.bool, device=key.device)
        seen = min(k_len, end - shift)
        real[:, :seen] = plan.real[:, shift : shift + seen]
        with torch.no_grad():
            weights, sink = row_weights(query, key, plan.sequences, rows, real, cached - shift, scaling, mask, kwargs,
                                        is_causal, sinks)
        take = inside.cpu().numpy()
        computed = weights[:, :, :, :seen].to(torch.float16).cpu().numpy()
        for s, r in zip(*np.nonzero(take), strict=True):
            captured.weights[s, :, r, shift : shift + seen] = computed[s, :, r]
            if sink is not None and captured.sink is not None:
                captured.sink[s, :, r] = sink[s, :, r].to(torch.float16).cpu().numpy()
        captured.filled |= take

    def _decode_step(self, state: _Request, captured: Capture, index: int, query: torch.Tensor, key: torch.Tensor,
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

    def _plan(self, state: _Request, k_len: int, offset: int, device: torch.device) -> Plan | None:
        """The request's plan (made at its first traced layer, the same at every layer)."""
        if (k_len, offset) not in state.plans:
            padding = state.prompt_mask if state.prompt_mask is not None else state.padding
            state.plans[(k_len, offset)] = make_plan(padding, state.request_ids, state.sampled, k_len, offset,
                                                     self.rows, self.seed, device)
        return state.plans[(k_len, offset)]

    def traces(self, capture: Capture) -> list[tuple[Any, ...]]:
        """A capture's traces (on the sender thread)."""
        return capture_traces(capture, self._templates[capture.layer])

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


