"""Which request is which slice of a continuous-batching pass: transformers' batch processor,
found and read.

Under continuous batching the model's forward pass gets one packed sequence and the paged
cache (``cache``), not the requests it serves. They are known to the manager's batch
processor (``ContinuousBatchProcessor``): its current batch's request states in packing
order, each with its query length and (already advanced) position offset. This module
finds the processor of a cache and reads that batch, from what transformers 5.25 has,
and refuses, with :class:`Unreadable` and a message naming what is missing, whatever it
cannot read or whatever does not add up. A refusal serves the pass untraced (the caller
counts it as ``continuous_batching_unreadable``): a layout that changed under a new
transformers is said, never read wrong.

Finding the processor of a cache, in order:

1. one found before for that cache;
2. the ``batch_processor`` of the managers the model made since the tap was attached
   (:meth:`ProcessorLookup.watch` wraps the model instance's ``init_continuous_batching``,
   the entry point of ``generate_batch``, ``continuous_batching_context_manager`` and
   ``transformers serve``): public attributes, the way transformers' own server reads it;
3. a manager made before the tap was attached: the processor running the pass, among the
   calling frames (the pass runs inside its generation step).

What is read, all checked: the processor's ``cache``, ``scheduler.active_requests`` and
``waiting_requests``, ``output_router.deliver`` and ``deliver_batch``, and its batch:
``inputs_and_outputs.requests_in_batch`` (with asynchronous batching, that of the IO pair
being computed, ``io_pairs[current_pair].host_io``), each entry's ``query_length`` and
``state`` (``request_id``, ``position_offset``, ``initial_tokens``). The batch read must
match the pass: its query lengths those of ``cu_seq_lens_q`` (when that is on the host; on
an accelerator, where reading it would synchronise, their sum at most the packed length),
and a traced request's first position the pass's ``position_ids`` there (on the host).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

#: the transformers release whose continuous batching this module reads
WRITTEN_FOR = "5.25"


class Unreadable(Exception):
    """The batch of a continuous-batching pass cannot be read, or what was read does not
    match the pass; the message says what, for the log."""


@dataclass(frozen=True)
class Member:
    """One request's part of a packed pass."""

    state: Any  #: the engine's request state
    start: int  #: its first query token in the packed sequence
    past: int  #: the position of that token
    length: int  #: its query tokens


def _missing(what: str, exc: Exception) -> Unreadable:
    return Unreadable(f"transformers {transformers.__version__}'s continuous batching has no {what} ({exc}); the "
                      f"tap reads the layout of transformers {WRITTEN_FOR}, so its passes are served untraced")


class ProcessorLookup:
    """The batch processor of a paged cache (see the module documentation)."""

    def __init__(self) -> None:
        self._found: dict[int, weakref.ref[Any]] = {}  #: id(cache) → its processor
        self._managers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._wrapped: tuple[Any, Callable[..., Any]] | None = None

    def watch(self, model: Any) -> None:
        """Remember every manager ``model.init_continuous_batching`` makes or returns from
        now on (wrapped on the instance; :meth:`close` unwraps it)."""
        original = getattr(model, "init_continuous_batching", None)
        if original is None:  # not a generative model
            return

        def init_continuous_batching(*args: Any, **kwargs: Any) -> Any:
            manager = original(*args, **kwargs)
            with contextlib.suppress(TypeError):  # not weakly referenceable: found among the frames instead
                self._managers.add(manager)
            return manager

        model.init_continuous_batching = init_continuous_batching
        self._wrapped = (model, init_continuous_batching)

    def close(self) -> None:
        if self._wrapped is not None:
            model, wrapper = self._wrapped
            if model.__dict__.get("init_continuous_batching") is wrapper:
                del model.init_continuous_batching
            self._wrapped = None

    def find(self, cache: Any) -> Any:
        """The processor whose cache ``cache`` is; :class:`Unreadable` when none is found."""
        known = self._found.get(id(cache))
        processor = known() if known is not None else None
        if processor is not None and getattr(processor, "cache", None) is cache:
            return processor
        for manager in list(self._managers):
            candidate = getattr(manager, "batch_processor", None)
            if isinstance(candidate, ContinuousBatchProcessor) and getattr(candidate, "cache", None) is cache:
                return self._remember(cache, candidate)
        frame = sys._getframe(1)
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, ContinuousBatchProcessor) and getattr(candidate, "cache", None) is cache:
                return self._remember(cache, candidate)
            frame = frame.f_back  # type: ignore[assignment]
        raise Unreadable(f"no ContinuousBatchProcessor of transformers {transformers.__version__} holds the paged "
                         "cache of this pass (looked at the batch_processor of the managers made since the tap was "
                         "attached, then at the calling frames); the tap reads the layout of transformers "
                         f"{WRITTEN_FOR}, so the pass is served untraced")

    def _remember(self, cache: Any, processor: Any) -> Any:
        for path in _READ:
            value = processor
            for attribute in path.split("."):
                try:
                    value = getattr(value, attribute)
                except AttributeError as exc:
                    raise _missing(f"ContinuousBatchProcessor.{path}", exc) from exc
        self._found = {key: ref for key, ref in self._found.items() if ref() is not None}  # processors gone
        self._found[id(cache)] = weakref.ref(processor)
        return processor


#: the processor's attributes read besides its batch, checked when it is found
_READ = ("inputs_and_outputs", "scheduler.active_requests", "scheduler.waiting_requests", "output_router.deliver",
         "output_router.deliver_batch")


def batch_requests(processor: Any) -> list[Any]:
    """The entries of the processor's current batch as the engine holds them, in packing
    order (each with its ``state`` and ``query_length``)."""
    ios = processor.inputs_and_outputs
    try:
        pairs = getattr(ios, "io_pairs", None)
        if pairs is not None:  # asynchronous batching: the pair of the batch being computed
            ios = pairs[ios.current_pair].host_io
        return list(ios.requests_in_batch)
    except (AttributeError, IndexError, TypeError) as exc:
        raise _missing("batch in inputs_and_outputs.requests_in_batch", exc) from exc


def batch_members(processor: Any) -> list[Member]:
    """Every request of the processor's current batch, in packing order."""
    batch = batch_requests(processor)
    members, start = [], 0
    try:
        for future in batch:
            state, length = future.state, int(future.query_length)
            members.append(Member(state, start, int(state.position_offset) - length, length))
            start += length
    except (AttributeError, TypeError, ValueError) as exc:
        raise _missing("query_length and state.position_offset on the batch's entries", exc) from exc
    return members


def check_against_pass(members: Sequence[Member], traced: Sequence[Member], kwargs: dict[str, Any]) -> None:
    """:class:`Unreadable` unless the batch read matches the pass: the query lengths those of
    ``cu_seq_lens_q`` (only their sum against the packed length on an accelerator: no read
    back), and each traced request's first position the pass's ``position_ids`` there."""
    packed = kwargs.get("input_ids", kwargs.get("position_ids"))
    total = sum(m.length for m in members)
    if isinstance(packed, torch.Tensor) and total > packed.shape[-1]:
        raise Unreadable(f"the batch read from the processor has {total} query tokens, the pass {packed.shape[-1]}: "
                         "the pass is served untraced")
    bounds = kwargs.get("cu_seq_lens_q")
    if isinstance(bounds, torch.Tensor) and bounds.device.type == "cpu":
        lengths = torch.diff(bounds).tolist()[: len(members)]
        if lengths != [m.length for m in members]:
            raise Unreadable(f"the batch read from the processor has query lengths {[m.length for m in members]}, the "
                             f"pass {lengths}: the pass is served untraced")
    positions = kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.device.type == "cpu" and traced:
        first, read = positions.reshape(-1)[[m.start for m in traced]].tolist(), [m.past for m in traced]
        if first != read:
            raise Unreadable(f"the batch read from the processor puts requests at positions {read}, the pass at "
                             f"{first}: the pass is served untraced")


def present(processor: Any, engine_id: str) -> bool:
    """Whether the processor still serves ``engine_id`` (running or waiting)."""
    scheduler = processor.scheduler
    return engine_id in scheduler.active_requests or engine_id in scheduler.waiting_requests
