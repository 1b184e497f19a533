"""The SHA-256 of a checkpoint's files, read once at most.

A model's revision is named by its safetensors files' SHA-256 digests
(:func:`~monitor.protocol.contract_derivation.checkpoint_revision`). Hashing a 140 GB
checkpoint takes minutes, and most checkpoints already carry their files' digests, so a
file is read only when nothing trustworthy names its content:

- a file in the Hugging Face Hub's cache (``…/snapshots/<commit>/<file>``) is a link to
  ``…/blobs/<sha256>``: the Hub names every large (LFS) file by its SHA-256;
- a file of a directory that ``hf download --local-dir`` filled has
  ``.cache/huggingface/download/<file>.metadata``, whose second line is that same
  SHA-256, trusted (as huggingface_hub trusts it) while the file is no newer than the
  metadata;
- a file this machine hashed before is remembered under ``$XDG_CACHE_HOME``
  (``~/.cache``) ``/attention-monitor/file-digests``, keyed by its path, device, inode,
  size and modification and change times, so any write to it (or a copy, a move, a
  ``touch``) makes it be read again;
- any other file is read and hashed, and remembered.

A digest that is already there names the file as its source names it: a file edited in
place in the Hub's cache keeps its blob's name, as it does for huggingface_hub itself.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)
_SHA256 = re.compile(r"[0-9a-f]{64}")


def file_digests(paths: Sequence[Path]) -> dict[Path, str]:
    """Each file's SHA-256 (hex): from what already names its content, else read (one
    file after another: on the 2-core machine of docs/performance.md, hashing files in
    parallel threads was slower than in turn)."""
    return {path: known_digest(path) or _hash_and_remember(path) for path in paths}


def known_digest(path: Path) -> str | None:
    """The file's SHA-256 without reading it, or None when nothing names its content."""
    return _hub_blob(path) or _local_dir_metadata(path) or _remembered(path)


def _hub_blob(path: Path) -> str | None:
    """A Hub cache snapshot's file links to ``blobs/<sha256>``."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    if target.parent.name == "blobs" and _SHA256.fullmatch(target.name):
        return target.name
    return None


def _local_dir_metadata(path: Path) -> str | None:
    """``hf download --local-dir``'s record of the file: commit, etag (the SHA-256 of an
    LFS file), and when it was written; stale once the file is newer (its rule)."""
    record = path.parent / ".cache" / "huggingface" / "download" / f"{path.name}.metadata"
    try:
        lines = record.read_text().splitlines()
        etag, written = lines[1].strip(), float(lines[2])
        modified = path.stat().st_mtime
    except (OSError, IndexError, ValueError):
        return None
    return etag if _SHA256.fullmatch(etag) and modified - 1 <= written else None


def _memo(path: Path) -> Path | None:
    """Where this machine remembers the file's digest, for the file as it is now."""
    try:
        st = path.stat()
    except OSError:
        return None
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = f"{path.resolve()}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
    return base / "attention-monitor" / "file-digests" / hashlib.sha256(key.encode()).hexdigest()


def _remembered(path: Path) -> str | None:
    memo = _memo(path)
    try:
        text = memo.read_text().strip() if memo is not None else ""
    except OSError:
        return None
    return text if _SHA256.fullmatch(text) else None


def _hash_and_remember(path: Path) -> str:
    memo = _memo(path)
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if memo is not None and _memo(path) == memo:  # unchanged while it was read
        written = None
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=memo.parent, delete=False) as out:
                written = out.name
                out.write(digest + "\n")
            os.replace(written, memo)
        except OSError as exc:  # a read-only home: the digest is still right, only not remembered
            log.debug("could not remember the digest of %s: %s", path, exc)
            if written is not None:
                Path(written).unlink(missing_ok=True)
    return digest
