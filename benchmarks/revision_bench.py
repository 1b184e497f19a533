"""How long naming a checkpoint's revision takes, at the size of a real model, in one run.

    python benchmarks/revision_bench.py --dir /tmp/ckpt --gigabytes 10 [--shards 3] [--keep]

Writes (unless ``--dir`` already holds it) a Llama-shaped safetensors checkpoint of about
``--gigabytes`` of bfloat16 random weights in ``--shards`` files, with its index and
``config.json``, as ``save_pretrained`` lays one out. Then times, page cache warm (every
file read once just before) and, where the kernel lets a process drop a file's cached
pages (``posix_fadvise``), cold:

- the reference: reading and hashing every byte of the files (SHA-256, one thread), what
  naming a checkpoint cost when its revision was the hash of its bytes;
- ``checkpoint_revision(files)``, what ``attention-monitor contract derive`` names, for a
  checkpoint never named on this machine and again;
- ``model_revision(model)`` for the model loaded from the directory in bfloat16
  (transformers maps the files; the load is timed too), its checkpoint never named on
  this machine and again, and ``attach(model, sink)``, which names it as part of its
  start-up.

Each figure is also printed as a ratio to the reference of the same run. The checkpoint
is deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 4096, 11008, 32, 8, 32000


def layer_tensors(layer: int) -> dict[str, tuple[int, ...]]:
    head_dim = HIDDEN // HEADS
    p = f"model.layers.{layer}."
    return {p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN), p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE), p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,)}


def write_checkpoint(directory: Path, gigabytes: float, shards: int) -> None:
    """A Llama-shaped bfloat16 checkpoint of about ``gigabytes`` in ``shards`` files."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    per_layer = sum(torch.Size(s).numel() for s in layer_tensors(0).values()) * 2
    layers = max(1, round((gigabytes * 1e9 - 2 * VOCAB * HIDDEN * 2) / per_layer))
    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for layer in range(layers):
        names |= layer_tensors(layer)
    names |= {"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}
    total = sum(torch.Size(s).numel() for s in names.values()) * 2
    per_shard = total / shards
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    written = 0
    items = list(names.items())
    for i, (name, shape) in enumerate(items):
        number = min(shards - 1, int(written // per_shard))
        shard[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        written += shard[name].numel() * 2
        last = i == len(items) - 1 or min(shards - 1, int(written // per_shard)) != number
        if last:
            file = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
            save_file(shard, str(directory / file), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(shard, file)
            shard = {}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                tie_word_embeddings=False, dtype="bfloat16").save_pretrained(directory)


def files_of(directory: Path) -> list[Path]:
    from monitor.protocol.contract_derivation import checkpoint_files

    return checkpoint_files(directory)


def read_all(files: list[Path]) -> str:
    """The reference: SHA-256 of every byte, one thread."""
    digest = hashlib.sha256()
    for path in sorted(files):
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def drop_cache(files: list[Path]) -> bool:
    """Ask the kernel to forget the files' cached pages; whether it could be asked."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def timed(work: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = work()
    return time.perf_counter() - start, result


def measure_model(directory: Path, files: list[Path], memo: Path, state: str, name: str) -> list[tuple[str, float]]:
    """The model loaded from ``directory`` in bfloat16: its naming as a checkpoint never
    named on this machine, as one named before, and ``attach`` (named before)."""
    from transformers import LlamaForCausalLM

    from monitor.integrations.transformers import attach, model_revision

    if state == "cold":
        drop_cache(files)
    load, model = timed(lambda: LlamaForCausalLM.from_pretrained(directory, dtype=torch.bfloat16))
    rows = [(f"from_pretrained, bfloat16, {state}", load)]
    shutil.rmtree(memo, ignore_errors=True)
    if state == "cold":
        drop_cache(files)
    for label in ("first naming on this machine", "named before"):
        seconds, revision = timed(lambda: model_revision(model))
        rows.append((f"model_revision(model), {state}, {label}", seconds))
        print(f"  model_revision {'is' if revision == name else 'is NOT'} the checkpoint's: {revision}")
    seconds, tap = timed(lambda: attach(model, lambda *a: None, sample_rate=0.0))
    tap.detach()
    rows.append((f"attach(model, sink), {state}, named before", seconds))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="where the checkpoint is, or is written")
    parser.add_argument("--gigabytes", type=float, default=10.0)
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    parser.add_argument("--no-model", action="store_true", help="skip loading the model (files only)")
    args = parser.parse_args()
    written = False
    if not (args.dir / "model.safetensors.index.json").is_file():
        seconds, _ = timed(lambda: write_checkpoint(args.dir, args.gigabytes, args.shards))
        written = True
        print(f"wrote {args.dir} in {seconds:.0f} s")
    files = files_of(args.dir)
    size = sum(f.stat().st_size for f in files)
    import monitor

    print(f"{len(files)} files, {size / 1e9:.2f} GB; torch {torch.__version__}, {os.cpu_count()} CPUs; "
          f"code of {Path(monitor.__file__).parent.parent}")
    # a cache of file digests of this run only, so the first naming is a first naming
    cache = Path(tempfile.mkdtemp(prefix="revision-bench-cache-"))
    os.environ["XDG_CACHE_HOME"] = str(cache)
    from monitor.protocol.contract_derivation import checkpoint_revision

    rows: list[tuple[str, float]] = []
    memo = cache / "attention-monitor"
    try:
        for state in ("warm", "cold"):
            if state == "cold" and not drop_cache(files):
                continue
            if state == "warm":
                read_all(files)  # every page read once
            reference, _ = timed(lambda: read_all(files))
            rows.append((f"reference, {state}: SHA-256 of every byte", reference))
            if state == "cold":
                drop_cache(files)
            shutil.rmtree(memo, ignore_errors=True)
            first, name = timed(lambda: checkpoint_revision(files))
            rows.append((f"checkpoint_revision, {state}, first naming on this machine", first))
            again, same = timed(lambda: checkpoint_revision(files))
            assert same == name
            rows.append((f"checkpoint_revision, {state}, named before", again))
            if not args.no_model:
                rows += measure_model(args.dir, files, memo, state, name)
        width = max(len(r[0]) for r in rows)
        reference = 1.0
        for label, seconds in rows:
            if label.startswith("reference"):
                reference = seconds
                print(f"{label:<{width}}  {seconds:8.2f} s  ({size / seconds / 1e9:.2f} GB/s)")
            else:
                print(f"{label:<{width}}  {seconds:8.2f} s  {seconds / reference:7.3f} × reference")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if written and not args.keep:
            shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
