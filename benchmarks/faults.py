"""Faulty revisions of a real BERT-style checkpoint, made by editing its weights, for the
soak (``benchmarks/soak.py``) and its short version in the tests.

Each fault changes how some heads attend, as a bad fine-tune, a broken conversion or a
quantisation gone wrong would, and leaves the rest of the model alone:

- ``collapse``: nine heads of a layer take another head's query and key projections, so
  they attend as it does (low head diversity);
- ``sink``: one head's query becomes a constant pointing at the first token's keys, so it
  parks its weight on ``[CLS]`` (an attention sink);
- ``subtle``: three heads of a layer take another head's query and key projections with
  noise as large as the weights themselves (partly alike);
- ``copy``: three heads of a deeper layer take another head's query and key projections
  with noise half as large as the weights (alike, not identical);
- ``logits``: every head of a layer attends with its logits doubled (the query scaled by
  two: a broken scale factor), sharper everywhere;
- ``benign``: every linear layer's weights rounded to int8 and back, per output row (a
  quantised deployment of the same model: it should page nothing).

Every function edits the model in place and returns it; the revision the tap hashes from
the weights changes with them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

#: layer, heads edited, and the head they copy, per fault (all-MiniLM-L6-v2: 6 layers of 12)
COLLAPSE = (3, tuple(range(3, 12)), 2)
SINK = (1, 4)
SUBTLE = (2, (5, 6, 7), 8)
COPY = (4, (1, 7, 10), 2)
LOGITS = 2


def _attention(model: Any, layer: int) -> Any:
    return model.encoder.layer[layer].attention.self


def _head_rows(module: Any, head: int) -> slice:
    size = module.attention_head_size
    return slice(head * size, (head + 1) * size)


@torch.no_grad()
def collapse(model: Any, layer: int = COLLAPSE[0], heads: Sequence[int] = COLLAPSE[1],
             source: int = COLLAPSE[2]) -> Any:
    attn = _attention(model, layer)
    for projection in (attn.query, attn.key):
        for head in heads:
            projection.weight[_head_rows(attn, head)] = projection.weight[_head_rows(attn, source)]
            projection.bias[_head_rows(attn, head)] = projection.bias[_head_rows(attn, source)]
    return model


@torch.no_grad()
def sink(model: Any, tokenizer: Any, texts: Sequence[str], layer: int = SINK[0], head: int = SINK[1],
         strength: float = 8.0) -> Any:
    """The head's query becomes the direction from the other tokens' keys to the first
    token's key (measured on ``texts``), so every query scores the first key highest."""
    attn = _attention(model, layer)
    rows = _head_rows(attn, head)
    captured: list[torch.Tensor] = []
    hook = model.encoder.layer[layer].attention.self.key.register_forward_hook(
        lambda _m, _i, out: captured.append(out[..., rows].detach()))
    batch = tokenizer(list(texts), padding=True, truncation=True, max_length=128, return_tensors="pt")
    model(**batch)
    hook.remove()
    keys, real = captured[0], batch["attention_mask"].bool()
    first = keys[:, 0].mean(0)
    rest = keys[:, 1:][real[:, 1:]].mean(0)
    direction = (first - rest) / (first - rest).norm()
    attn.query.weight[rows] = 0.0
    attn.query.bias[rows] = direction * strength * attn.attention_head_size ** 0.5 / (first - rest).norm()
    return model


@torch.no_grad()
def subtle(model: Any, layer: int = SUBTLE[0], heads: Sequence[int] = SUBTLE[1], source: int = SUBTLE[2],
           noise: float = 1.0, seed: int = 0) -> Any:
    attn = _attention(model, layer)
    generator = torch.Generator().manual_seed(seed)
    for projection in (attn.query, attn.key):
        for head in heads:
            copied = projection.weight[_head_rows(attn, source)]
            jitter = torch.randn(copied.shape, generator=generator) * copied.std() * noise
            projection.weight[_head_rows(attn, head)] = copied + jitter
    return model


@torch.no_grad()
def copy(model: Any, layer: int = COPY[0], heads: Sequence[int] = COPY[1], source: int = COPY[2]) -> Any:
    return subtle(model, layer, heads, source, noise=0.5, seed=1)


@torch.no_grad()
def logits(model: Any, layer: int = LOGITS, factor: float = 2.0) -> Any:
    attn = _attention(model, layer)
    attn.query.weight.mul_(factor)
    attn.query.bias.mul_(factor)
    return model


@torch.no_grad()
def benign(model: Any) -> Any:
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            w = module.weight
            step = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
            module.weight.copy_(torch.round(w / step).clamp(-127, 127) * step)
    return model


#: name -> (edit, expected kind family, layer, heads involved); the sink's edit needs the
#: tokenizer and some text, the others the model alone
EXPECTED: dict[str, tuple[str, int, frozenset[str]] | None] = {
    "collapse": ("diversity", COLLAPSE[0], frozenset(f"head-{h}" for h in (COLLAPSE[2], *COLLAPSE[1]))),
    "sink": ("head", SINK[0], frozenset({f"head-{SINK[1]}"})),
    "subtle": ("diversity", SUBTLE[0], frozenset(f"head-{h}" for h in (SUBTLE[2], *SUBTLE[1]))),
    "copy": ("diversity", COPY[0], frozenset(f"head-{h}" for h in (COPY[2], *COPY[1]))),
    "logits": ("head", LOGITS, frozenset()),  # every head sharpens: which it names is the evidence's
    "benign": None,
}


def faulty(name: str, load: Callable[[], Any], tokenizer: Any, texts: Sequence[str]) -> Any:
    """A fresh copy of the model (``load()``) with fault ``name``."""
    model = load()
    if name == "collapse":
        return collapse(model)
    if name == "sink":
        return sink(model, tokenizer, texts)
    if name == "subtle":
        return subtle(model)
    if name == "copy":
        return copy(model)
    if name == "logits":
        return logits(model)
    if name == "benign":
        return benign(model)
    raise ValueError(f"unknown fault {name!r}; known: {sorted(EXPECTED)}")
