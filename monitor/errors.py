"""One root for the monitor's errors, with a ``retriable`` flag.

Data errors (a producer sent something we refuse) are :class:`TraceRejected` with a
reason from :class:`RejectReason`: they are counted, dead-lettered and never retried.
Infrastructure errors are retried while ``retriable`` and otherwise end the process
with a clear message and a non-zero exit code.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import Any


class ExitCode(IntEnum):
    """How the ``attention-monitor`` commands end; the one table of exit codes."""

    OK = 0
    FAILED = 1  #: a check failed (an audit FAIL, unusable settings or files)
    USAGE = 2  #: bad usage or unreadable input
    INFRASTRUCTURE = 3  #: Kafka unreachable, a topic missing or not authorized, outputs not written
    MEASURING = 4  #: the process that measures traces died
    INTERRUPTED = 130


class MonitorError(Exception):
    """Root of the monitor's errors."""

    retriable: bool = False


class RejectReason(StrEnum):
    """Why a record was refused: a closed set, used as the ``reason`` label."""

    MALFORMED = "malformed"  # truncated or garbage bytes, unparsable or invalid header
    UNKNOWN_SCHEMA_VERSION = "unknown_schema_version"
    OVERSIZED = "oversized"  # record bytes or heads/rows/keys beyond the limits
    UNSUPPORTED_DTYPE = "unsupported_dtype"
    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad_signature"
    UNKNOWN_KEY = "unknown_key"
    SCOPE_DENIED = "scope_denied"
    SHAPE_MISMATCH = "shape_mismatch"  # header and payload disagree
    UNKNOWN_CONTRACT = "unknown_contract"
    CONTRACT_MISMATCH = "contract_mismatch"  # model, revision, layer, mask, scale, dims
    HEAD_MISMATCH = "head_mismatch"  # head ids not unique or not the contract's
    KV_GROUP_MISMATCH = "kv_group_mismatch"
    NON_FINITE = "non_finite"
    NEGATIVE = "negative"
    MASKED_MASS = "masked_mass"  # weight on keys the mask hides, beyond tolerance
    ROW_SUM = "row_sum"  # a row does not sum to 1 within tolerance


class TraceRejected(MonitorError):
    """A record was refused; ``reason`` is from the closed set, ``detail`` says more."""

    def __init__(self, reason: RejectReason, detail: str):
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
        #: the parsed header when the record got that far (its signature verified)
        self.header: Any = None


class InfrastructureError(MonitorError):
    """Kafka, the network or the filesystem failed us."""

    def __init__(self, message: str, *, retriable: bool):
        super().__init__(message)
        self.retriable = retriable


class ConfigurationError(MonitorError):
    """Settings or files given to the monitor are unusable."""


class MeasuringFailed(MonitorError):
    """The process (or thread) that measures traces died; nothing was committed for
    the records in flight, so they are read again after a restart."""
