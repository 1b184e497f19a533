"""Model contracts from a transformers model's own config, and revisions from its weights."""

from __future__ import annotations

import contextlib
import hashlib
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from monitor.protocol.contract_derivation import (
    CheckpointError,
    checkpoint_files,
    checkpoint_revision,
    default_mask,
    layer_windows,
    read_header,
)
from monitor.protocol.model_contract import LayerContract, ModelContract

log = logging.getLogger(__name__)


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


def model_revision(model: Any) -> str:
    """The revision a model's traces carry. A model that holds exactly the weights of the
    safetensors checkpoint it was loaded from (each tensor the file's, cast to the dtype
    it was loaded in) is named as ``attention-monitor contract derive`` names that
    checkpoint: by its files (:func:`checkpoint_revision`), whatever the dtype, so a pin
    by the derived revision pins its traces. Any other model (built in memory, changed
    after loading, quantized) is named by its loaded weights (:func:`weights_revision`),
    and the log says why."""
    files = loaded_from(model)
    if files is None:
        return weights_revision(model)
    differs = _differs_from(model, files)
    if differs is None:
        return checkpoint_revision(files)
    log.info("%s: not the weights of %s (%s): its revision is that of its loaded weights, not the checkpoint's",
             type(model).__name__, files[0].parent, differs)
    return weights_revision(model)


def loaded_from(model: Any) -> list[Path] | None:
    """The safetensors files of the checkpoint ``model`` was loaded from (a directory, or
    a hub id in the local cache), or None."""
    name = getattr(model, "name_or_path", None) or ""
    if not name:
        return None
    directory = Path(name)
    if not directory.is_dir():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json", revision=getattr(model.config, "_commit_hash", None))
        if not isinstance(cached, str):
            return None
        directory = Path(cached).parent
    try:
        return checkpoint_files(directory)
    except CheckpointError:
        return None


#: torch dtypes by their safetensors names, for comparing a tensor with a file's bytes
_STORED_AS = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _differs_from(model: Any, files: list[Path]) -> str | None:
    """How the model's state differs from the checkpoint files, or None when it holds
    them exactly. Every tensor is compared whole: one kept in the file's dtype byte for
    byte with the file's bytes (mapped, not copied, and moved to the tensor's device
    rather than the tensor to the CPU), any other cast to the loaded dtype first. File
    tensors the model does not keep (old position-id buffers) do not matter, and a tensor
    tied to one that matched (an output embedding) is that one."""
    from safetensors import safe_open

    state = model.state_dict()
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    matched: set[int] = set()
    seen: set[str] = set()
    for path in files:
        header, length = read_header(path)
        tensors = {key: info for key, info in header.items() if key != "__metadata__"}
        data = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + length) if tensors else np.empty(0, np.uint8)
        opened: dict[str, Any] = {}  # the file opened by safetensors, per device, for tensors loaded in another dtype
        with contextlib.ExitStack() as stack:
            for key, info in tensors.items():
                name = next((n for n in (key, prefix + key, key.removeprefix(prefix)) if n in state), None)
                if name is None or name in seen:
                    continue
                loaded = state[name].detach()
                if list(loaded.shape) != info["shape"]:
                    return f"{name} differs (shape {list(loaded.shape)}, the file's {info['shape']})"
                if _STORED_AS.get(loaded.dtype) == info["dtype"]:
                    start, end = info["data_offsets"]
                    same = _same_bytes(loaded, torch.from_numpy(data[start:end]))
                else:
                    device = str(loaded.device)
                    if device not in opened:
                        opened[device] = stack.enter_context(safe_open(str(path), framework="pt", device=device))
                    same = torch.equal(opened[device].get_tensor(key).to(loaded.dtype), loaded)
                if not same:
                    return f"{name} differs"
                seen.add(name)
                matched.add(loaded.data_ptr())
    for name, tensor in state.items():
        if name not in seen and tensor.data_ptr() not in matched:
            return f"{name} is not in the checkpoint"
    return None


def _same_bytes(loaded: torch.Tensor, stored: torch.Tensor) -> bool:
    """Whether ``loaded``'s bytes are ``stored`` (a file's bytes), compared on
    ``loaded``'s device, eight bytes at a time where both line up."""
    ours = loaded.contiguous().view(-1).view(torch.uint8)
    if ours.numel() != stored.numel():
        return False
    theirs = stored.to(loaded.device)
    if ours.numel() % 8 == 0:
        with contextlib.suppress(RuntimeError):  # a storage offset that is not a multiple of 8
            ours, theirs = ours.view(torch.int64), theirs.view(torch.int64)
    return torch.equal(ours, theirs)
