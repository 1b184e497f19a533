"""A checkpoint's revision without reading files whose digests are already known: the
Hub's cache, ``hf download --local-dir``'s records, digests this machine computed before;
the name is the one ``sha256sum`` gives, and a file that changed is read again."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from monitor.protocol import file_digests
from monitor.protocol.contract_derivation import CheckpointError, checkpoint_revision


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files read and hashed (by name)."""
    seen: list[str] = []
    original = file_digests.hashlib.file_digest

    def counting(f, digest):  # type: ignore[no-untyped-def]
        seen.append(Path(f.name).name)
        return original(f, digest)

    monkeypatch.setattr(file_digests.hashlib, "file_digest", counting)
    return seen


def write_safetensors(path: Path, seed: int, rows: int = 64) -> Path:
    """A real safetensors file: a header naming two float32 tensors, then their bytes."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((rows, 16), np.float32), rng.standard_normal(16, np.float32)
    header = {"__metadata__": {"format": "pt"},
              "layers.0.self_attn.q_proj.weight": {"dtype": "F32", "shape": [rows, 16], "data_offsets": [0, a.nbytes]},
              "layers.0.input_layernorm.weight": {"dtype": "F32", "shape": [16],
                                                  "data_offsets": [a.nbytes, a.nbytes + b.nbytes]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + a.tobytes() + b.tobytes())
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_revision_is_what_sha256sum_lists_and_a_second_naming_reads_nothing(tmp_path, reads):
    files = [write_safetensors(tmp_path / f"model-0000{n}-of-00002.safetensors", n) for n in (2, 1)]
    revision = checkpoint_revision(files)
    listing = subprocess.run(["sha256sum", *sorted(f.name for f in files)], cwd=tmp_path, check=True,
                             capture_output=True).stdout
    assert revision == f"sha256:{hashlib.sha256(listing).hexdigest()}"
    assert sorted(reads) == sorted(f.name for f in files)
    reads.clear()
    assert checkpoint_revision(files) == revision and reads == []  # remembered


def test_a_changed_file_is_read_again_and_renamed(tmp_path, reads):
    path = write_safetensors(tmp_path / "model.safetensors", 0)
    before = checkpoint_revision([path])
    write_safetensors(path, 1)  # same size, other weights
    reads.clear()
    after = checkpoint_revision([path])
    assert reads == ["model.safetensors"] and after != before
    assert after == checkpoint_revision([write_safetensors(tmp_path / "copy" / "model.safetensors", 1)])


def test_a_file_in_the_hub_cache_is_named_by_its_blob_without_reading_it(tmp_path, reads):
    """The Hub's cache links a snapshot's files to blobs named by their SHA-256."""
    repo = tmp_path / "hub" / "models--org--name"
    made = write_safetensors(tmp_path / "made" / "model.safetensors", 3)
    blob = repo / "blobs" / sha256(made)
    blob.parent.mkdir(parents=True)
    made.rename(blob)
    snapshot = repo / "snapshots" / ("c0ffee" * 6 + "c0ff")
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(Path("../..") / "blobs" / blob.name)
    plain = write_safetensors(tmp_path / "plain" / "model.safetensors", 3)
    assert checkpoint_revision([snapshot / "model.safetensors"]) == checkpoint_revision([plain])
    assert reads == ["model.safetensors"]  # the plain copy only


def test_hf_download_local_dir_records_are_used_while_the_file_is_not_newer(tmp_path, reads):
    path = write_safetensors(tmp_path / "local" / "model.safetensors", 4)
    record = tmp_path / "local" / ".cache" / "huggingface" / "download" / "model.safetensors.metadata"
    record.parent.mkdir(parents=True)
    record.write_text(f"{'ab' * 20}\n{sha256(path)}\n{time.time()}\n")
    named = checkpoint_revision([path])
    assert reads == []
    later = time.time() + 60
    os.utime(path, (later, later))  # written after the record: the record no longer speaks for it
    assert checkpoint_revision([path]) == named and reads == ["model.safetensors"]


def test_a_truncated_file_is_refused_not_named(tmp_path):
    path = write_safetensors(tmp_path / "model.safetensors", 5)
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint_revision([path])


def test_a_cache_that_cannot_be_written_still_names_the_file(tmp_path, monkeypatch, reads):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    path = write_safetensors(tmp_path / "model.safetensors", 6)
    assert checkpoint_revision([path]) == checkpoint_revision([path])
    assert reads == ["model.safetensors"] * 2
