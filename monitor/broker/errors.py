"""Kafka client errors as the monitor's :class:`~monitor.errors.InfrastructureError`."""

from __future__ import annotations

from monitor.errors import InfrastructureError


def infrastructure_error(action: str, exc: Exception) -> InfrastructureError:
    """``exc`` from kafka-python, keeping its ``retriable`` flag."""
    retriable = bool(getattr(exc, "retriable", False))
    return InfrastructureError(f"{action}: {type(exc).__name__}: {exc}", retriable=retriable)
