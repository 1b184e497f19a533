"""Content identities: names derived from what a thing *is*, not where it came from.

``content_id(kind, value)`` is ``f"{kind}@sha256:{hex}"`` where ``hex`` is the SHA-256 of
``kind``, a newline, and the canonical serialization of ``value``. The same value gives
the same identity in every run, process and machine; any change gives another.

Canonical serialization (version 1)
-----------------------------------
JSON text, UTF-8, keys sorted, no insignificant whitespace, ``ensure_ascii``:

- ``None``, ``bool``, ``int`` and ``str`` as JSON;
- a finite ``float`` as its shortest round-trip decimal (Python's ``repr``); NaN and
  infinities are refused;
- a mapping as an object (keys must be strings), a list or tuple as an array;
- a numpy array as ``{"array": {"dtype": "<f8", "shape": [...], "sha256": hex}}``, the
  hash taken over its C-order little-endian bytes after conversion to the dtype named
  (float64 for floating arrays, int64 for integer arrays, bool as one byte each).
  Given data (parameters, inputs) is hashed exactly this way.
- :func:`quantized` turns a *computed* float array into a mapping of its values
  rounded to 12 significant digits, written as decimal strings, so that results which
  differ only by the last bits of floating-point rounding across CPUs and BLAS
  libraries share one identity.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

SCHEME_VERSION = 1
SIGNIFICANT_DIGITS = 12


def canonical_bytes(value: Any) -> bytes:
    """The canonical serialization of ``value`` (see the module documentation)."""
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def content_id(kind: str, value: Any) -> str:
    """``kind@sha256:<hex>`` of ``value``'s canonical serialization."""
    if not kind or any(c in kind for c in "@\n"):
        raise ValueError(f"kind must be a non-empty name without '@' or newlines, got {kind!r}")
    digest = hashlib.sha256(kind.encode("utf-8") + b"\n" + canonical_bytes(value)).hexdigest()
    return f"{kind}@sha256:{digest}"


def array_digest(array: NDArray[Any]) -> dict[str, Any]:
    """The canonical stand-in for an array: dtype, shape and SHA-256 of its bytes."""
    a = np.asarray(array)
    if a.dtype.kind == "f":
        if not np.isfinite(a).all():
            raise ValueError("arrays in content identities must be finite")
        a, tag = a.astype("<f8"), "<f8"
    elif a.dtype.kind in "iu":
        a, tag = a.astype("<i8"), "<i8"
    elif a.dtype.kind == "b":
        a, tag = a.astype("|b1"), "|b1"
    else:
        raise ValueError(f"unsupported array dtype for content identities: {a.dtype}")
    data = np.ascontiguousarray(a).tobytes()
    return {"array": {"dtype": tag, "shape": list(a.shape), "sha256": hashlib.sha256(data).hexdigest()}}


def quantized(array: NDArray[Any], digits: int = SIGNIFICANT_DIGITS) -> dict[str, Any]:
    """A computed float array as decimal strings with ``digits`` significant digits."""
    a = np.asarray(array, dtype=np.float64)
    if not np.isfinite(a).all():
        raise ValueError("arrays in content identities must be finite")
    values = [_decimal(float(x), digits) for x in a.ravel()]
    return {"quantized": {"digits": digits, "shape": list(a.shape), "values": values}}


def _decimal(x: float, digits: int) -> str:
    if x == 0.0:
        return "0"
    return f"{x:.{digits - 1}e}"


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("NaN and infinity have no canonical form")
        return value
    if isinstance(value, np.ndarray):
        return array_digest(value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("mapping keys must be strings in a canonical serialization")
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence):
        return [_plain(v) for v in value]
    raise ValueError(f"no canonical form for {type(value).__name__}")
