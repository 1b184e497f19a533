"""Trace records: ``encode`` for producers, ``decode`` for the monitor.

``decode`` returns a validated :class:`Trace` or raises :class:`TraceRejected` with a
reason from :class:`RejectReason`; nothing else escapes, whatever the bytes. Checks run
cheapest and most fundamental first: sizes (before any allocation), framing, the
signature (before the header is parsed), the header, limits, scope, the model
contract, then the values.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray
from pydantic import ValidationError

from monitor.core.mass import row_mass, value_fault
from monitor.errors import RejectReason, TraceRejected
from monitor.protocol import wire
from monitor.protocol.access import Keyring, ScopePolicy
from monitor.protocol.model_contract import LayerContract, ModelContract
from monitor.protocol.schema import TraceHeader

#: ``"contract_id": "<id>"`` with no escape in the id
_NAMED_CONTRACT = re.compile(rb'"contract_id"\s*:\s*"([^"\\\x00-\x1f]*)"')
DTYPES: dict[str, np.dtype[Any]] = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4")}
ContractLookup = Callable[[str], ModelContract | None] | Mapping[str, ModelContract]


@dataclass(frozen=True)
class Limits:
    """Hard limits and tolerances. Sizes are checked before anything is allocated."""

    max_record_bytes: int = 16 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    max_heads: int = 256
    max_rows: int = 1024
    max_keys: int = 262_144
    dtypes: frozenset[str] = frozenset(DTYPES)
    #: largest weight mass a row may put on keys its mask hides
    masked_mass_tolerance: float = 1e-3
    #: largest |row sum − 1| over valid keys, by dtype (float16 rounds each weight to 11 bits)
    row_sum_tolerance_float16: float = 1e-2
    row_sum_tolerance_float32: float = 1e-4


@dataclass(frozen=True)
class Trace:
    """A decoded, verified trace. ``weights`` is a read-only view into the record."""

    header: TraceHeader
    weights: NDArray[np.generic]  #: [heads, rows, keys]
    valid: NDArray[np.bool_]  #: [rows, keys], True where the row may see the key
    contract: ModelContract
    layer: LayerContract
    key_id: str
    sink: NDArray[np.generic] | None = None  #: [heads, rows]: each row's mass on the learned sink


def encode(header: TraceHeader, weights: NDArray[np.generic], key_id: str, secret: bytes,
           sink: NDArray[np.generic] | None = None) -> bytes:
    """One signed record. ``weights [heads, rows, keys]`` must match the header's shape
    and dtype, and so must ``sink [heads, rows]`` (each row's mass on a learned sink),
    given exactly when the header says ``learned_sink``; nothing is converted behind the
    producer's back. Header fields at their defaults are left out of the record."""
    want = DTYPES[header.dtype]
    arrays: list[tuple[str, NDArray[np.generic], tuple[int, ...]]] = [("weights", np.asarray(weights), header.shape)]
    if header.learned_sink != (sink is not None):
        raise ValueError("give the sink's mass exactly when the header says learned_sink")
    if sink is not None:
        arrays.append(("sink", np.asarray(sink), header.shape[:2]))
    for name, array, shape in arrays:
        if array.dtype.newbyteorder("<") != want:
            raise ValueError(f"{name} are {array.dtype}, the header says {header.dtype}")
        if array.shape != shape:
            raise ValueError(f"{name} have shape {array.shape}, the header says {shape}")
    payload = b"".join(np.ascontiguousarray(array, dtype=want).tobytes() for _, array, _ in arrays)
    return wire.pack(header.model_dump_json(exclude_defaults=True).encode(), payload, key_id, secret)


def valid_keys(header: TraceHeader) -> NDArray[np.bool_]:
    """``[rows, keys]``: what each sampled row may see under the header's mask semantics
    (read-only: a request's traces, one a layer, share it)."""
    return _visible(header.mask, header.key_count, tuple(header.query_positions), header.window, header.padding,
                    header.padding_side)


@functools.lru_cache(maxsize=8)
def _visible(mask: str, k: int, query_positions: tuple[int, ...], window: int | None, padding: int,
             padding_side: str) -> NDArray[np.bool_]:
    """:func:`valid_keys` of these header fields, kept for the 8 seen last (each a byte a
    weight of one head: no more than the record it came with, already checked against
    ``Limits.max_record_bytes``)."""
    keys = _key_indices(k)
    visible: NDArray[np.bool_]
    if mask == "causal":
        positions = np.array(query_positions)[:, None]
        visible = keys[None, :] <= positions
        if window is not None:
            visible &= keys[None, :] > positions - window
    else:
        visible = np.ones((len(query_positions), k), dtype=bool)
    if padding:
        pad = keys < padding if padding_side == "left" else keys >= k - padding
        visible &= ~pad[None, :]
    visible.flags.writeable = False
    return visible


@functools.lru_cache(maxsize=8)
def _key_indices(k: int) -> NDArray[np.intp]:
    """``0 … k-1``, read-only, kept for the 8 key counts seen last (at most 8 x 8 bytes x
    ``Limits.max_keys``)."""
    keys = np.arange(k)
    keys.flags.writeable = False
    return keys


def decode(
    data: bytes | memoryview,
    *,
    keyring: Keyring,
    scopes: ScopePolicy,
    contracts: ContractLookup,
    limits: Limits | None = None,
    check_mass: bool = True,
    check_values: bool = True,
) -> Trace:
    """Verify and validate one record; raise :class:`TraceRejected` otherwise.

    ``check_mass=False`` leaves the masked-mass and row-sum checks to the caller, who
    runs :func:`check_mass` on the row masses it measures anyway (the pipeline gets them
    from the metrics pass, so each trace is converted once). ``check_values=False``
    leaves the NaN, infinity and negative-weight checks to the caller: the metrics core
    refuses such weights in its own pass, and the caller then runs :func:`check_values`
    to say which fault it was.
    """
    limits = limits or Limits()
    frame = wire.unpack(data, limits.max_record_bytes, limits.max_header_bytes)
    if frame.key_id is None:
        raise TraceRejected(RejectReason.UNSIGNED, "record carries no signature")
    secret = keyring.secret(frame.key_id)
    if secret is None:
        raise TraceRejected(RejectReason.UNKNOWN_KEY, f"key id {frame.key_id[:64]!r} is not in the keyring")
    if not wire.verify(frame, secret):
        raise TraceRejected(RejectReason.BAD_SIGNATURE, f"HMAC does not verify under key {frame.key_id!r}")
    header = _parse_header(frame.header)
    try:
        weights, sink = _payload(header, frame.payload, limits)
        if not scopes.permits(header.scope):
            raise TraceRejected(RejectReason.SCOPE_DENIED,
                                f"scope {header.scope.tenant}:{header.scope.data_class} is not allowed here")
        key = keyring.key(frame.key_id)
        if key is not None and not key.may_sign(header.scope.tenant):
            raise TraceRejected(RejectReason.SCOPE_DENIED,
                                f"key {frame.key_id!r} may not sign traces of tenant {header.scope.tenant!r}")
        contract, layer = _contract(header, contracts)
        valid = valid_keys(header)
        if check_values:
            _check_values(weights)
            if sink is not None:
                _check_values(sink)
        if check_mass:
            shown, hidden = row_mass(weights, valid)
            _check_mass(header, shown, hidden, valid, limits, sink)
    except TraceRejected as exc:
        exc.header = header
        raise
    return Trace(header, weights, valid, contract, layer, frame.key_id, sink)


def named_contract(data: bytes | memoryview | None, limits: Limits | None = None) -> str | None:
    """The contract id a record's header names, read without verifying anything (the
    service only decides with it whether to read the contracts topic before handing the
    record on); None when the record has no readable header naming one.

    A header with one ``"contract_id"`` whose value is a plain string is read by a byte
    scan (parsing the whole header costs several times more, in the service's busiest
    thread); anything else is parsed. A wrong answer costs at most a read of the contracts topic:
    decode judges the record."""
    limits = limits or Limits()
    try:
        frame = wire.unpack(data or b"", limits.max_record_bytes, limits.max_header_bytes)
        header = bytes(frame.header)
        if header.count(b'"contract_id"') == 1 and (found := _NAMED_CONTRACT.search(header)) is not None:
            return found.group(1).decode()
        doc = json.loads(header)
    except (TraceRejected, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    named = doc.get("contract_id") if isinstance(doc, dict) else None
    return named if isinstance(named, str) else None


def _parse_header(raw: memoryview) -> TraceHeader:
    text = bytes(raw)
    try:
        return TraceHeader.model_validate_json(text)  # one pass, for the headers that are valid
    except ValidationError:
        pass  # find out why, and say it as the checks below do
    try:
        doc: Any = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise TraceRejected(RejectReason.MALFORMED, "header is not JSON") from exc
    if not isinstance(doc, dict):
        raise TraceRejected(RejectReason.MALFORMED, "header is not a JSON object")
    if doc.get("schema_version", 1) != 1:
        raise TraceRejected(RejectReason.UNKNOWN_SCHEMA_VERSION, f"header schema_version {doc['schema_version']!r}")
    try:
        return TraceHeader.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "header"
        raise TraceRejected(RejectReason.MALFORMED, f"header field {where}: {first['msg']}") from exc


def _payload(header: TraceHeader, payload: memoryview,
             limits: Limits) -> tuple[NDArray[np.generic], NDArray[np.generic] | None]:
    h, r, k = header.shape
    if h > limits.max_heads or r > limits.max_rows or k > limits.max_keys:
        raise TraceRejected(RejectReason.OVERSIZED, f"shape {[h, r, k]} exceeds limits "
                            f"{[limits.max_heads, limits.max_rows, limits.max_keys]}")
    if header.dtype not in limits.dtypes:
        raise TraceRejected(RejectReason.UNSUPPORTED_DTYPE, f"dtype {header.dtype} is not accepted here")
    dtype = DTYPES[header.dtype]
    size = h * r * k * dtype.itemsize
    expected = size + (h * r * dtype.itemsize if header.learned_sink else 0)
    if len(payload) != expected:
        shape = f"shape {[h, r, k]}" + (f" and a learned sink's {[h, r]}" if header.learned_sink else "")
        raise TraceRejected(RejectReason.SHAPE_MISMATCH,
                            f"payload has {len(payload)} bytes, {shape} of {header.dtype} needs {expected}")
    weights: NDArray[np.generic] = np.frombuffer(payload[:size], dtype=dtype).reshape(h, r, k)
    sink = np.frombuffer(payload[size:], dtype=dtype).reshape(h, r) if header.learned_sink else None
    return weights, sink


def _contract(header: TraceHeader, contracts: ContractLookup) -> tuple[ModelContract, LayerContract]:
    contract = contracts.get(header.contract_id) if isinstance(contracts, Mapping) else contracts(header.contract_id)
    if contract is None:
        raise TraceRejected(RejectReason.UNKNOWN_CONTRACT, f"contract {header.contract_id[:120]} is not known")
    mismatch = [
        f"{name} {got!r} != contract {want!r}"
        for name, got, want in (
            ("model_id", header.model_id, contract.model_id),
            ("model_revision", header.model_revision, contract.model_revision),
            ("mask", header.mask, contract.mask),
            ("scale", header.scale, contract.scale),
        )
        if got != want
    ]
    layer = contract.layer(header.layer)
    if layer is None:
        mismatch.append(f"layer {header.layer} is not in the contract")
    else:
        mismatch += [f"{name} {got!r} != contract's {want!r} for layer {layer.layer}" for name, got, want in (
            ("window", header.window, layer.window), ("learned_sink", header.learned_sink, bool(layer.learned_sink)))
            if got != want]
    if mismatch or layer is None:
        raise TraceRejected(RejectReason.CONTRACT_MISMATCH, "; ".join(mismatch))
    if len(set(header.heads)) != len(header.heads):
        raise TraceRejected(RejectReason.HEAD_MISMATCH, "head ids are not unique")
    if header.heads != layer.heads:
        raise TraceRejected(RejectReason.HEAD_MISMATCH, f"heads are not the contract's {len(layer.heads)} heads "
                            f"of layer {layer.layer} in declared order")
    if header.kv_groups != layer.kv_groups:
        raise TraceRejected(RejectReason.KV_GROUP_MISMATCH, f"KV groups differ from the contract's for layer "
                            f"{layer.layer}")
    return contract, layer


def check_values(trace: Trace) -> None:
    """The NaN, infinity and negative-weight checks of :func:`decode`, on a decoded
    trace; raises :class:`TraceRejected` (with the header attached)."""
    try:
        _check_values(trace.weights)
    except TraceRejected as exc:
        exc.header = trace.header
        raise


def _check_values(weights: NDArray[np.generic]) -> None:
    fault = value_fault(weights)
    if fault == "non_finite":
        raise TraceRejected(RejectReason.NON_FINITE, "weights contain NaN or infinity")
    if fault == "negative":
        raise TraceRejected(RejectReason.NEGATIVE, "weights contain negative values")


def check_mass(trace: Trace, shown: NDArray[np.float64], hidden: NDArray[np.float64], limits: Limits) -> None:
    """The masked-mass and row-sum checks of :func:`decode`, on row masses ``[H, R]``
    measured elsewhere; raises :class:`TraceRejected` (with the header attached)."""
    try:
        _check_mass(trace.header, shown, hidden, trace.valid, limits, trace.sink)
    except TraceRejected as exc:
        exc.header = trace.header
        raise


def masses_within(shown: NDArray[np.float64], hidden: NDArray[np.float64], valid: NDArray[np.bool_],
                  dtype: str, limits: Limits) -> NDArray[np.bool_]:
    """For a batch of traces (row masses ``[B, H, R]``, valid keys ``[B, 1, R, K]``),
    which pass both checks of :func:`check_mass`: one pass over the batch, so only the
    few that fail need the per-trace check that says why."""
    batch = len(shown)
    tolerance = limits.row_sum_tolerance_float16 if dtype == "float16" else limits.row_sum_tolerance_float32
    seeing = valid.any(axis=-1)
    error = np.abs(np.where(seeing, shown - 1.0, 0.0)).reshape(batch, -1).max(axis=1)
    worst_hidden = hidden.reshape(batch, -1).max(axis=1)
    ok: NDArray[np.bool_] = (worst_hidden <= limits.masked_mass_tolerance) & (error <= tolerance)
    return ok


def _check_mass(header: TraceHeader, shown: NDArray[np.float64], hidden: NDArray[np.float64],
                valid: NDArray[np.bool_], limits: Limits, sink: NDArray[np.generic] | None = None) -> None:
    """Rows put no weight on keys their mask hides, and sum to one over their valid keys
    (with a learned sink: the keys' and the sink's mass together)."""
    worst_hidden = float(hidden.max())
    if worst_hidden > limits.masked_mass_tolerance:
        raise TraceRejected(RejectReason.MASKED_MASS, f"a row puts {worst_hidden:.3g} of its weight on keys its "
                            f"{header.mask} mask hides (tolerance {limits.masked_mass_tolerance})")
    tolerance = limits.row_sum_tolerance_float16 if header.dtype == "float16" else limits.row_sum_tolerance_float32
    seeing = np.asarray(valid.any(axis=-1))[None, :]  # rows with no visible key must carry no weight (checked above)
    total = shown if sink is None else shown + np.asarray(sink, dtype=np.float64)
    error = np.abs(np.where(seeing, total - 1.0, 0.0))
    worst = int(np.argmax(error))
    if error.flat[worst] > tolerance:
        over = "over its valid keys" if sink is None else "over its valid keys and the learned sink"
        raise TraceRejected(RejectReason.ROW_SUM, f"a row sums to {total.flat[worst]:.4g} {over} "
                            f"(tolerance {tolerance})")
