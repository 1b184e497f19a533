"""Wrapping a transformers model's attention, whatever implementation it runs and without
renaming it: the base of the attention tap (which reads) and of head ablation (which
intervenes).

transformers' modeling code asks ``ALL_ATTENTION_FUNCTIONS.get_interface(config.
_attn_implementation, eager_attention_forward)`` for the attention function of every layer
call. While any wrapper is installed, that lookup is wrapped (on the one global
``ALL_ATTENTION_FUNCTIONS`` instance, not on the class): it returns, for the function the
model would have got, a dispatcher that calls that very function and then, for the
modules of wrapped models only, hands its output to :meth:`AttentionWrapper.around`.
Every other model in the process gets the unchanged output of its own function.

The model's implementation name is never changed, so whatever transformers decides from
the name stays as it is: continuous batching's choice of a packed block-diagonal mask
(``utils.attn_mask_is_needed``), its switch from ``eager`` to ``paged|eager``, the mask
function. A wrapper installed or removed while a continuous-batching manager runs changes
nothing the model computes. Wrappers stack (a tap and an ablation on one model): each
sees the output of the one installed before it. :meth:`restore` removes the wrapper; the
last one out puts the lookup back.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

_ids = itertools.count()
_lock = threading.Lock()
#: id(attention module) -> (the module, the wrappers around it in installation order);
#: replaced, never mutated, so the forward pass reads it without a lock
_wrapped: dict[int, tuple[Any, tuple[AttentionWrapper, ...]]] = {}
#: the function transformers returned -> its dispatcher (one per function, made once)
_dispatchers: dict[Callable[..., Any], Callable[..., Any]] = {}
_original_get_interface: Callable[..., Any] | None = None


def _dispatcher(function: Callable[..., Any]) -> Callable[..., Any]:
    found = _dispatchers.get(function)
    if found is not None:
        return found

    def dispatch(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        output = function(module, query, key, value, attention_mask, *args, **kwargs)
        entry = _wrapped.get(id(module))
        if entry is None or entry[0] is not module:
            return output
        for wrapper in entry[1]:
            output = wrapper.around(module, output, query, key, attention_mask, kwargs)
        return output

    dispatch.__wrapped__ = function  # type: ignore[attr-defined]
    _dispatchers[function] = dispatch
    return dispatch


def _get_interface(attn_implementation: str, default: Callable[..., Any]) -> Callable[..., Any]:
    original = _original_get_interface
    function = (original(attn_implementation, default) if original is not None
                else type(ALL_ATTENTION_FUNCTIONS).get_interface(ALL_ATTENTION_FUNCTIONS, attn_implementation, default))
    return _dispatcher(function)


def _install(wrapper: AttentionWrapper, modules: list[Any]) -> None:
    global _wrapped, _original_get_interface
    with _lock:
        table = dict(_wrapped)
        for module in modules:
            entry = table.get(id(module))
            table[id(module)] = (module, (*entry[1], wrapper) if entry and entry[0] is module else (wrapper,))
        _wrapped = table
        if _original_get_interface is None:
            _original_get_interface = ALL_ATTENTION_FUNCTIONS.get_interface
            ALL_ATTENTION_FUNCTIONS.get_interface = _get_interface  # type: ignore[method-assign]


def _remove(wrapper: AttentionWrapper) -> None:
    global _wrapped, _original_get_interface
    with _lock:
        table = {}
        for key, (module, wrappers) in _wrapped.items():
            kept = tuple(w for w in wrappers if w is not wrapper)
            if kept:
                table[key] = (module, kept)
        _wrapped = table
        if not table and _original_get_interface is not None:
            if ALL_ATTENTION_FUNCTIONS.__dict__.get("get_interface") is _get_interface:
                del ALL_ATTENTION_FUNCTIONS.get_interface
            _original_get_interface = None


class AttentionWrapper:
    def __init__(self, model: Any, prefix: str):
        self.model = model
        self._layer_of: dict[int, int] = {}
        self.name = f"{prefix}-{next(_ids)}"
        self.installed = True
        _install(self, list(model.modules()))  # only attention modules ever reach a dispatcher

    def around(self, module: Any, output: Any, query: torch.Tensor, key: torch.Tensor,
               attention_mask: Any, kwargs: dict[str, Any]) -> Any:
        """What the wrapper returns in place of ``output`` (the implementation's
        ``(attn_output [batch, queries, heads, head_dim], attn_weights)``)."""
        return output

    def restore(self) -> None:
        """Stop wrapping: the model's attention calls reach its own implementation alone."""
        if self.installed:
            self.installed = False
            _remove(self)

    def layer(self, module: Any) -> int:
        """The layer number of an attention module (its ``layer_idx``, else its rank)."""
        number = self._layer_of.get(id(module))
        if number is None:
            index = getattr(module, "layer_idx", None)
            if not isinstance(index, int):
                same = [m for m in self.model.modules() if type(m) is type(module)]
                index = next(i for i, m in enumerate(same) if m is module)
            number = self._layer_of[id(module)] = index
        return number
