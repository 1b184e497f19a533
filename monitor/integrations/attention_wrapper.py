"""Wrapping a transformers model's attention, whatever implementation it runs: the base
of the attention tap (which reads) and of head ablation (which intervenes).

transformers routes every modern model's attention through ``AttentionInterface``. A
:class:`AttentionWrapper` registers a function there, under a name of its own, that calls
the implementation the model was loaded with (``eager`` through the model's own
``eager_attention_forward``) and hands the result to :meth:`AttentionWrapper.around`; the
model's mask function is registered under the same name, so the wrapped implementation
sees the very mask it would see unwrapped. Wrappers stack: a wrapper installed over
another calls it as the model's implementation. :meth:`restore` puts back the
implementation found at installation.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

_ids = itertools.count()


class AttentionWrapper:
    def __init__(self, model: Any, prefix: str):
        self.model = model
        self._original_name: str = model.config._attn_implementation
        self._eager: dict[type, Callable[..., Any]] = {}
        self._layer_of: dict[int, int] = {}
        self.name = f"{prefix}-{next(_ids)}"
        AttentionInterface.register(self.name, self._attention)
        AttentionMaskInterface.register(self.name, ALL_MASK_ATTENTION_FUNCTIONS[self._original_name])
        self.installed = True
        model.set_attn_implementation(self.name)

    def around(self, module: Any, output: Any, query: torch.Tensor, key: torch.Tensor,
               attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> Any:
        """What the wrapper returns in place of ``output`` (the implementation's
        ``(attn_output [batch, queries, heads, head_dim], attn_weights)``)."""
        return output

    def restore(self) -> None:
        """The model's own attention implementation again."""
        if self.installed:
            self.installed = False
            self.model.set_attn_implementation(self._original_name)

    def _attention(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        output = self._implementation(module)(module, query, key, value, attention_mask, *args, **kwargs)
        if not self.installed:
            return output
        return self.around(module, output, query, key, attention_mask, kwargs)

    def _implementation(self, module: Any) -> Callable[..., Any]:
        if self._original_name != "eager":
            return ALL_ATTENTION_FUNCTIONS[self._original_name]  # type: ignore[no-any-return]
        cls = type(module)
        if cls not in self._eager:
            function = getattr(sys.modules[cls.__module__], "eager_attention_forward", None)
            if function is None:
                raise RuntimeError(f"{cls.__module__} has no eager_attention_forward to wrap; load the model with "
                                   "attn_implementation='sdpa'")
            self._eager[cls] = function
        return self._eager[cls]

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
