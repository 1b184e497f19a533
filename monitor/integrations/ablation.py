"""Head ablation through the same attention wrapper as the tap: the chosen heads' outputs
(their attention-weighted values, before the output projection mixes heads) replaced
by their mean over reference data, or by zero.

::

    ablation = HeadAblation(model)
    with ablation.observing():          # learn each head's mean output and output norm
        model(**reference_batch)
    with ablation.ablating([(2, 3)]):   # layer 2, head 3
        model(**batch)
    ablation.restore()

Mean ablation keeps the scale of the residual stream the model expects, so what changes
is the information the head carries, not the magnitude; zero ablation is the blunter
option. Padding is excluded from the means (the 2-D ``attention_mask`` the model is
called with).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch

from monitor.integrations.attention_wrapper import AttentionWrapper

Head = tuple[int, int]  #: (layer, head index)
Mode = Literal["mean", "zero"]


class HeadAblation(AttentionWrapper):
    def __init__(self, model: Any):
        self._sums: dict[int, torch.Tensor] = {}  #: layer → [H, D] sum of head outputs over real tokens
        self._norm_sums: dict[int, torch.Tensor] = {}  #: layer → [H] sum of output norms
        self._tokens: dict[int, float] = {}
        self._observing = False
        self._ablate: dict[int, list[int]] = {}
        self._mode: Mode = "mean"
        self._means: dict[int, torch.Tensor] = {}
        self._padding: torch.Tensor | None = None
        self._forward = inspect.signature(model.forward)
        self._hook = model.register_forward_pre_hook(self._remember_padding, with_kwargs=True)
        super().__init__(model, "attention-monitor-ablation")

    # --- learning what a head normally outputs -----------------------------------------

    @contextlib.contextmanager
    def observing(self) -> Iterator[None]:
        """Accumulate every head's output (sum and norm) over the forward passes inside."""
        self._observing = True
        try:
            yield
        finally:
            self._observing = False

    def reset(self) -> None:
        self._sums.clear()
        self._norm_sums.clear()
        self._tokens.clear()

    def snapshot(self) -> dict[int, tuple[torch.Tensor, torch.Tensor, float]]:
        """Per layer: the sums of head outputs [H, D], of their norms [H], and the token
        count, accumulated so far (add snapshots of disjoint data to pool them)."""
        return {layer: (self._sums[layer].clone(), self._norm_sums[layer].clone(), self._tokens[layer])
                for layer in self._sums}

    def use_means(self, sums: dict[int, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Mean ablation replaces a head's output by its mean over the data of ``sums``."""
        self._means = {layer: total / max(tokens, 1.0) for layer, (total, _, tokens) in sums.items()}

    # --- intervening --------------------------------------------------------------------

    @contextlib.contextmanager
    def ablating(self, heads: Iterable[Head], mode: Mode = "mean") -> Iterator[None]:
        """Inside the block, the outputs of ``heads`` are replaced (their mean, from
        :meth:`use_means`, or zero)."""
        chosen: dict[int, list[int]] = {}
        for layer, head in heads:
            chosen.setdefault(layer, []).append(head)
        if mode == "mean" and not set(chosen) <= set(self._means):
            raise ValueError(f"no mean output known for layers {sorted(set(chosen) - set(self._means))}: "
                             "observe reference data and call use_means first")
        self._ablate, self._mode = chosen, mode
        try:
            yield
        finally:
            self._ablate = {}

    def restore(self) -> None:
        super().restore()
        self._hook.remove()

    # --- inside the forward pass ---------------------------------------------------------

    def _remember_padding(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            mask = self._forward.bind_partial(*args, **kwargs).arguments.get("attention_mask")
        except TypeError:
            mask = kwargs.get("attention_mask")
        self._padding = mask.detach() if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None

    def around(self, module: Any, output: Any, query: torch.Tensor, key: torch.Tensor,
               attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> Any:
        attn_output = output[0]  # [batch, queries, heads, head_dim]
        layer = self.layer(module)
        if self._observing:
            self._observe(layer, attn_output.detach())
        heads = self._ablate.get(layer)
        if not heads:
            return output
        changed = attn_output.clone()
        if self._mode == "zero":
            changed[:, :, heads, :] = 0
        else:
            changed[:, :, heads, :] = self._means[layer][heads].to(changed.dtype)
        return (changed, *output[1:])

    def _observe(self, layer: int, attn_output: torch.Tensor) -> None:
        z = attn_output.float()
        batch, queries = z.shape[:2]
        weight = torch.ones(batch, queries, device=z.device)
        if self._padding is not None and self._padding.shape == (batch, queries):
            weight = self._padding.to(z.device).float()
        w = weight[:, :, None, None]
        sums = (z * w).sum(dim=(0, 1))
        norms = (z.norm(dim=-1) * weight[:, :, None]).sum(dim=(0, 1))
        if layer in self._sums:
            self._sums[layer] += sums
            self._norm_sums[layer] += norms
            self._tokens[layer] += float(weight.sum())
        else:
            self._sums[layer], self._norm_sums[layer], self._tokens[layer] = sums, norms, float(weight.sum())
