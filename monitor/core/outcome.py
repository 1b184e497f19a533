"""A task outcome as it travels with a trace: what counts (``result``), how it was given
(``label``, ``score``), and when.

``result`` is ``success`` or ``failure`` (a failure, in metrics and alerts, is exactly an
outcome whose result says so: ``docs/wire-format.md``), or, for a trace without one,
``pending`` (its join window closed; the outcome may still come within
``OUTCOME_WINDOW_S``) or ``missing`` (that window closed too).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KNOWN", "MISSING", "PENDING", "Outcome"]

#: results that are outcomes given
KNOWN = ("success", "failure")


@dataclass(frozen=True, slots=True)
class Outcome:
    result: str
    label: str | None = None
    score: float | None = None
    at: float = 0.0  #: when it was given (the outcome record's event time; 0: none was)

    @property
    def known(self) -> bool:
        return self.result in KNOWN


PENDING = Outcome("pending")
MISSING = Outcome("missing")
