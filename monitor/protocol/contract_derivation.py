"""Derive a model contract from a checkpoint's tensors (safetensors) and its config.

Head counts, head dimensions and KV groups come from the actual tensor shapes; the
config only names the number of query heads (and, when present, is checked against
what the tensors say). Nothing is assumed from ``d_model / H``.

Only the safetensors *header* is read for shapes: 8 bytes little-endian header length,
then a JSON object ``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": …}``.
The model revision is the SHA-256 of the checkpoint files' SHA-256 digests, as
``sha256sum`` lists them (:func:`checkpoint_revision`), so it names the weights exactly
without reading a file whose digest is already known; the transformers tap names a model
loaded from these files, in any dtype, by the same revision.

Tensor names differ by family; :data:`PATTERNS` knows decoder names (Llama, Mistral,
Qwen3, Gemma 3, gpt-oss, Phi-3: ``self_attn.q_proj``…), encoder (BERT-style), DistilBERT
and GPT-2 (a fused ``c_attn`` holding query, key and value), and any other scheme is one
regular expression away (``pattern``, ``--pattern``): it must name the groups ``layer``
and ``proj``, where ``proj`` is one of the names in :data:`PROJECTIONS`. Sliding windows
come from the config (``layer_types`` and ``sliding_window``: :func:`layer_windows`),
learned sinks from the tensors (``self_attn.sinks``, gpt-oss), and Gemma's
``query_pre_attn_scalar`` sets the scale.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from monitor.protocol.file_digests import file_digests
from monitor.protocol.model_contract import LayerContract, ModelContract

MAX_HEADER_BYTES = 100 * 1024 * 1024
#: attention projection tensors, by naming scheme
PATTERNS = {
    # Llama, Mistral, Qwen, Gemma, gpt-oss, …: model.layers.N.self_attn.{q,k,v,o}_proj.weight;
    # Phi-3 fuses query, key and value row-wise: self_attn.qkv_proj.weight
    "decoder": r"(?:^|\.)layers\.(?P<layer>\d+)\.self_attn\.(?P<proj>[qkvo]|qkv)_proj\.weight$",
    # BERT, RoBERTa, MiniLM, ELECTRA, …: encoder.layer.N.attention.self.query.weight, ….output.dense.weight
    "encoder": r"(?:^|\.)layer\.(?P<layer>\d+)\.attention\.(?P<proj>self\.(?:query|key|value)|output\.dense)\.weight$",
    # DistilBERT: transformer.layer.N.attention.{q,k,v,out}_lin.weight
    "distilbert": r"(?:^|\.)layer\.(?P<layer>\d+)\.attention\.(?P<proj>[qkv]|out)_lin\.weight$",
    # GPT-2: h.N.attn.c_attn.weight ([d_model, 3 · d_model], Conv1D: input first), h.N.attn.c_proj.weight
    "gpt2": r"(?:^|\.)h\.(?P<layer>\d+)\.attn\.(?P<proj>c_attn|c_proj)\.weight$",
}
#: a learned sink logit per head (gpt-oss): model.layers.N.self_attn.sinks
SINKS = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.self_attn\.sinks$")
#: what a ``proj`` group may say, and which projection it is
PROJECTIONS = {"q": "q", "k": "k", "v": "v", "o": "o", "out": "o", "query": "q", "key": "k", "value": "v",
               "self.query": "q", "self.key": "k", "self.value": "v", "output.dense": "o",
               "qkv": "qkv-rows", "c_attn": "qkv", "c_proj": "o-conv1d"}
#: model types whose self-attention is bidirectional (unless the config says is_decoder)
ENCODER_MODEL_TYPES = frozenset({"albert", "bert", "camembert", "deberta", "deberta-v2", "distilbert", "electra",
                                 "ernie", "modernbert", "mpnet", "roberta", "xlm-roberta"})


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a config that describes the attention layers (a multimodal config's
    ``text_config``)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def layer_windows(config: dict[str, Any]) -> list[int | None]:
    """Each layer's sliding window: ``layer_types`` (gpt-oss, Gemma 3, Qwen3:
    ``sliding_attention`` layers get ``sliding_window``), or ``sliding_window`` on every
    layer (Mistral, Phi-3) unless ``use_sliding_window`` is false."""
    c = text_config(config)
    layers = c.get("num_hidden_layers", c.get("n_layer"))
    if not isinstance(layers, int) or layers <= 0:
        raise CheckpointError("config.num_hidden_layers must be a positive integer")
    window = c.get("sliding_window")
    window = window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None
    types = c.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return [window if kind == "sliding_attention" else None for kind in types]
    if c.get("use_sliding_window") is False:
        return [None] * layers
    return [window] * layers


def default_mask(model_type: str | None, is_decoder: bool = False) -> str:
    """``bidirectional`` for encoder model types, ``causal`` otherwise."""
    return "bidirectional" if model_type in ENCODER_MODEL_TYPES and not is_decoder else "causal"


class CheckpointError(ValueError):
    """The checkpoint or config cannot give a consistent contract; the message says why."""


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (tensor name → ``dtype``, ``shape``, ``data_offsets``
    from the end of the header; ``__metadata__``) and the header's length in bytes."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: too short to be a safetensors file")
        (size,) = struct.unpack("<Q", head)
        if size == 0 or size > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: implausible safetensors header length {size}")
        raw = f.read(size)
    if len(raw) != size:
        raise CheckpointError(f"{path}: header truncated ({len(raw)} of {size} bytes)")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    return header, size


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape from a safetensors file's header."""
    header, _ = read_header(path)
    shapes = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointError(f"{path}: tensor {name} has no valid shape")
        shapes[name] = tuple(shape)
    return shapes


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files transformers loads from a checkpoint directory: those the
    index ``model.safetensors.index.json`` names, else ``model.safetensors``."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from exc
        files = [directory / name for name in names]
    else:
        files = [directory / "model.safetensors"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{directory}: no safetensors checkpoint ({', '.join(missing)} missing)")
    return files


def checkpoint_revision(paths: Sequence[Path]) -> str:
    """``sha256:…`` of the lines ``sha256sum`` prints for the files in file-name order
    (``<sha256 of the file>  <file name>``, one a line): in the checkpoint's directory,
    ``sha256sum FILE… | sha256sum`` gives the same. Each file's digest comes from what
    already names its content (the Hub's cache, ``hf download --local-dir``'s record, a
    digest this machine computed before: :mod:`~monitor.protocol.file_digests`), else the
    file is read once; every file must be a whole safetensors file, its size the one its
    header gives (a truncated file is refused, not named)."""
    ordered = sorted(paths, key=lambda p: (p.name, str(p)))
    for path in ordered:
        _check_whole(path)
    digests = file_digests(ordered)
    listing = "".join(f"{digests[path]}  {path.name}\n" for path in ordered)
    return f"sha256:{hashlib.sha256(listing.encode()).hexdigest()}"


def _check_whole(path: Path) -> None:
    """A safetensors file indexes every byte after its header: its size is 8 + the
    header's length + the end of its last tensor."""
    header, length = read_header(path)
    ends = [info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"
            and isinstance(info, dict) and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
            and isinstance(info["data_offsets"][1], int)]
    expected = 8 + length + max(ends, default=0)
    actual = path.stat().st_size
    if actual != expected:
        raise CheckpointError(f"{path}: {actual} bytes, but its header describes {expected}: truncated, or not "
                              "one safetensors file")


def derive_contract(
    paths: Sequence[Path],
    config: dict[str, Any],
    *,
    model_id: str,
    mask: str | None = None,
    scale: float | None = None,
    revision: str | None = None,
    pattern: str | None = None,
) -> ModelContract:
    """Build the model contract from checkpoint files and a Hugging Face style config.
    Without ``pattern`` every known naming scheme is tried; without ``mask``, encoder
    model types are bidirectional and everything else causal."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in paths:
        shapes.update(read_shapes(path))
    candidates = [pattern] if pattern is not None else list(PATTERNS.values())
    for candidate in candidates:
        projections = _projections(shapes, candidate)
        if projections:
            break
    else:
        sample = ", ".join(sorted(shapes)[:5])
        raise CheckpointError(f"no attention projections match {' or '.join(map(repr, candidates))} in "
                              f"{len(shapes)} tensors (e.g. {sample}); give --pattern with groups layer and proj")
    c = text_config(config)
    heads = c.get("num_attention_heads", c.get("n_head"))
    if not isinstance(heads, int) or heads <= 0:
        raise CheckpointError("config.num_attention_heads must be a positive integer")
    sinks = {int(match["layer"]) for name in shapes if (match := SINKS.search(name)) is not None}
    try:
        windows = layer_windows(config)
    except CheckpointError:
        windows = []
    layers = [_layer(n, projections[n], heads, c).model_copy(update={
        "window": windows[n] if n < len(windows) else None, "learned_sink": True if n in sinks else None})
        for n in sorted(projections)]
    head_dim = layers[0].head_dim
    scalar = c.get("query_pre_attn_scalar")
    return ModelContract(
        model_id=model_id,
        model_revision=revision or checkpoint_revision(paths),
        mask=mask or default_mask(c.get("model_type", config.get("model_type")), bool(c.get("is_decoder", False))),
        scale=scale if scale is not None else (float(scalar) if scalar else head_dim) ** -0.5,  # as transformers does
        layers=tuple(layers),
    )


def _projections(shapes: dict[str, tuple[int, ...]], pattern: str) -> dict[int, dict[str, tuple[int, ...]]]:
    """Layer → projection (q, k, v, o) → shape, for the tensors ``pattern`` matches."""
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise CheckpointError(f"pattern {pattern!r} is not a regular expression: {exc}") from exc
    if not {"layer", "proj"} <= regex.groupindex.keys():
        raise CheckpointError(f"pattern {pattern!r} must name the groups layer and proj")
    found: dict[int, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        match = regex.search(name)
        if match is None:
            continue
        proj = PROJECTIONS.get(match["proj"])
        if proj is None:
            raise CheckpointError(f"{name}: projection {match['proj']!r} is none of {sorted(PROJECTIONS)}")
        found.setdefault(int(match["layer"]), {})[proj] = shape
    return found


def _layer(number: int, proj: dict[str, tuple[int, ...]], heads: int, config: dict[str, Any]) -> LayerContract:
    if "qkv" in proj:  # GPT-2's fused Conv1D: [d_model, 3 · d_model], input first
        if len(proj["qkv"]) != 2 or proj["qkv"][1] % 3:
            raise CheckpointError(f"layer {number}: c_attn is {list(proj['qkv'])}, expected [d_model, 3 · d_model]")
        d_model, fused = proj.pop("qkv")
        proj |= dict.fromkeys("qkv", (fused // 3, d_model))
    if "qkv-rows" in proj:  # Phi-3: [q_out + 2 · k_out, d_model], split by the config's heads and groups
        out, d_model = proj.pop("qkv-rows")
        head_dim = config.get("head_dim") or d_model // heads
        groups = config.get("num_key_value_heads") or heads
        if heads * head_dim + 2 * groups * head_dim != out:
            raise CheckpointError(f"layer {number}: qkv_proj has {out} outputs, {heads} heads and {groups} KV groups "
                                  f"of {head_dim} need {heads * head_dim + 2 * groups * head_dim}")
        proj |= {"q": (heads * head_dim, d_model), "k": (groups * head_dim, d_model), "v": (groups * head_dim, d_model)}
    if "o-conv1d" in proj:  # [input, output]
        o_in, o_out = proj.pop("o-conv1d")
        proj["o"] = (o_out, o_in)
    missing = [p for p in "qkvo" if p not in proj]
    if missing:
        raise CheckpointError(f"layer {number}: missing {', '.join(p + '_proj' for p in missing)}")
    for p in "qkvo":
        if len(proj[p]) != 2:
            raise CheckpointError(f"layer {number}: {p}_proj is {list(proj[p])}, expected a matrix")
    (q_out, d_model), (k_out, k_in), (v_out, v_in), (o_out, o_in) = (proj[p] for p in "qkvo")
    if k_in != d_model or v_in != d_model or o_out != d_model:
        raise CheckpointError(f"layer {number}: projections disagree on d_model ({d_model}, {k_in}, {v_in}, {o_out})")
    if q_out % heads:
        raise CheckpointError(f"layer {number}: q_proj has {q_out} outputs, not divisible by {heads} heads")
    head_dim = q_out // heads
    declared = config.get("head_dim")
    if declared is not None and declared != head_dim:
        raise CheckpointError(f"layer {number}: config.head_dim {declared} but q_proj gives {head_dim}")
    if k_out % head_dim:
        raise CheckpointError(f"layer {number}: k_proj has {k_out} outputs, not a multiple of head_dim {head_dim}")
    groups = k_out // head_dim
    declared_groups = config.get("num_key_value_heads", heads)
    if declared_groups != groups:
        raise CheckpointError(f"layer {number}: config.num_key_value_heads {declared_groups} but k_proj gives {groups}")
    if heads % groups:
        raise CheckpointError(f"layer {number}: {heads} query heads cannot share {groups} KV groups evenly")
    if v_out % groups:
        raise CheckpointError(f"layer {number}: v_proj has {v_out} outputs for {groups} KV groups")
    value_dim = v_out // groups
    if o_in != heads * value_dim:
        raise CheckpointError(f"layer {number}: o_proj takes {o_in} inputs, heads give {heads * value_dim}")
    per_group = heads // groups
    return LayerContract(
        layer=number,
        d_model=d_model,
        head_dim=head_dim,
        value_dim=value_dim,
        heads=tuple(f"head-{h}" for h in range(heads)),
        kv_groups=tuple(h // per_group for h in range(heads)),
    )
