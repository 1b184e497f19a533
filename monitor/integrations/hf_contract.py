"""Model contracts from a transformers model's own config, and revisions from its weights."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from monitor.protocol.contract_derivation import default_mask, layer_windows
from monitor.protocol.model_contract import LayerContract, ModelContract


def _text_config(config: Any) -> Any:
    """The config that describes the attention layers (a multimodal config's text part)."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _positive(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"the config has no positive integer {name} (got {value!r}); give the contract by hand")
    return value


def contract_from_config(config: Any, model_id: str, revision: str, *, mask: str | None = None,
                         scale: float | None = None, sinks: frozenset[int] | None = None) -> ModelContract:
    """The model contract of any architecture transformers loads: layers, heads, KV groups
    and head dimensions from ``config``; each layer's sliding window
    (:func:`~monitor.protocol.contract_derivation.layer_windows`);
    the mask kind from the model type (encoders such as BERT are bidirectional) unless
    given; the scale ``head_dim ** -0.5`` (or the config's ``query_pre_attn_scalar **
    -0.5``) unless given; ``sinks``: the layers with learned sink logits (gpt-oss: every
    layer, when not given)."""
    c = _text_config(config)
    heads = _positive(c, "num_attention_heads")
    layers = _positive(c, "num_hidden_layers")
    d_model = _positive(c, "hidden_size")
    groups = getattr(c, "num_key_value_heads", None) or heads
    if heads % groups:
        raise ValueError(f"{heads} query heads cannot share {groups} KV heads evenly")
    head_dim = getattr(c, "head_dim", None) or d_model // heads
    if scale is None:
        scalar = getattr(c, "query_pre_attn_scalar", None)
        scale = float(scalar) ** -0.5 if scalar else head_dim**-0.5
    per_group = heads // groups
    if sinks is None and getattr(c, "model_type", None) == "gpt_oss":
        sinks = frozenset(range(layers))
    window = layer_windows(_text_config(config).to_dict())
    return ModelContract(
        model_id=model_id,
        model_revision=revision,
        mask=mask or default_mask(getattr(c, "model_type", None), bool(getattr(c, "is_decoder", False))),
        scale=scale,
        layers=tuple(
            LayerContract(layer=n, d_model=d_model, head_dim=head_dim, value_dim=head_dim,
                          heads=tuple(f"head-{h}" for h in range(heads)),
                          kv_groups=tuple(h // per_group for h in range(heads)), window=window[n],
                          learned_sink=True if sinks and n in sinks else None)
            for n in range(layers)
        ),
    )


def weights_revision(model: Any) -> str:
    """``sha256:…`` of every parameter and buffer (name, dtype, shape and bytes, in name
    order): the same weights give the same revision wherever they are loaded."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return f"sha256:{digest.hexdigest()}"
