"""Derive a model contract from a checkpoint's tensors (safetensors) and its config.

Head counts, head dimensions and KV groups come from the actual tensor shapes; the
config only names the number of query heads (and, when present, is checked against
what the tensors say). Nothing is assumed from ``d_model / H``.

Only the safetensors *header* is read for shapes: 8 bytes little-endian header length,
then a JSON object ``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": …}``.
The model revision is the SHA-256 of the checkpoint files' bytes (in the order given),
so it names the weights exactly.

Tensor names differ by family; :data:`PATTERNS` knows decoder (Llama-style), encoder
(BERT-style) and DistilBERT names, and any other scheme is one regular expression away
(``pattern``, ``--pattern``): it must name the groups ``layer`` and ``proj``, where
``proj`` is one of the names in :data:`PROJECTIONS`.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from monitor.protocol.model_contract import LayerContract, ModelContract

MAX_HEADER_BYTES = 100 * 1024 * 1024
#: attention projection tensors, by naming scheme
PATTERNS = {
    # Llama, Mistral, Qwen, Gemma, …: model.layers.N.self_attn.{q,k,v,o}_proj.weight
    "decoder": r"(?:^|\.)layers\.(?P<layer>\d+)\.self_attn\.(?P<proj>[qkvo])_proj\.weight$",
    # BERT, RoBERTa, MiniLM, ELECTRA, …: encoder.layer.N.attention.self.query.weight, ….output.dense.weight
    "encoder": r"(?:^|\.)layer\.(?P<layer>\d+)\.attention\.(?P<proj>self\.(?:query|key|value)|output\.dense)\.weight$",
    # DistilBERT: transformer.layer.N.attention.{q,k,v,out}_lin.weight
    "distilbert": r"(?:^|\.)layer\.(?P<layer>\d+)\.attention\.(?P<proj>[qkv]|out)_lin\.weight$",
}
#: what a ``proj`` group may say, and which projection it is
PROJECTIONS = {"q": "q", "k": "k", "v": "v", "o": "o", "out": "o", "query": "q", "key": "k", "value": "v",
               "self.query": "q", "self.key": "k", "self.value": "v", "output.dense": "o"}
#: model types whose self-attention is bidirectional (unless the config says is_decoder)
ENCODER_MODEL_TYPES = frozenset({"albert", "bert", "camembert", "deberta", "deberta-v2", "distilbert", "electra",
                                 "ernie", "modernbert", "mpnet", "roberta", "xlm-roberta"})


def default_mask(model_type: str | None, is_decoder: bool = False) -> str:
    """``bidirectional`` for encoder model types, ``causal`` otherwise."""
    return "bidirectional" if model_type in ENCODER_MODEL_TYPES and not is_decoder else "causal"


class CheckpointError(ValueError):
    """The checkpoint or config cannot give a consistent contract; the message says why."""


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape from a safetensors file's header."""
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
    shapes = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointError(f"{path}: tensor {name} has no valid shape")
        shapes[name] = tuple(shape)
    return shapes


def weights_hash(paths: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


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
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int) or heads <= 0:
        raise CheckpointError("config.num_attention_heads must be a positive integer")
    layers = [_layer(n, projections[n], heads, config) for n in sorted(projections)]
    head_dim = layers[0].head_dim
    return ModelContract(
        model_id=model_id,
        model_revision=revision or weights_hash(paths),
        mask=mask or default_mask(config.get("model_type"), bool(config.get("is_decoder", False))),
        scale=scale if scale is not None else head_dim**-0.5,  # as transformers computes it
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
