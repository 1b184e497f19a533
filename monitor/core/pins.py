"""Which revision's reference judges a model revision's traces: the one rule.

A revision is judged by its own reference unless it is *pinned* to another revision's
(to catch a regression at deploy); a pinned revision never learns a reference of its
own, and only a *promotion* makes it its own reference again. Pins come from three
places, and one :class:`Pins` takes them all in by the same rules, so that the instance
routing a trace to its judge and the judge agree:

- the settings (``REFERENCE_PINS``): the weakest; any other decision about the same
  revision overrides them;
- a saved state (a pin kept across a restart without the setting): of two decisions
  about a revision the later one holds (:meth:`Pins.merge`);
- the references topic (``attention-monitor reference pin|promote``), in order: a
  decision no later than the one held for its revision changes nothing
  (:meth:`Pins.decide`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Decision", "Pins", "Revision"]

Revision = tuple[str, str]  #: (model, revision)


@dataclass(frozen=True)
class Decision:
    """How a revision is judged: by the reference of ``pinned_to``, or (``None``, after a
    promotion) by its own."""

    pinned_to: str | None
    source: str  #: "settings", "promote", "pin"
    at: float  #: when it was decided (seconds since the epoch; 0 for settings)

    def to_dict(self) -> dict[str, Any]:
        return {"pinned_to": self.pinned_to, "source": self.source, "at": self.at}


class Pins:
    """Every revision's decision, and the rule that reads them (see the module)."""

    def __init__(self, settings: Mapping[Revision, str] | None = None):
        self.decisions: dict[Revision, Decision] = {
            pair: Decision(reference, "settings", 0.0) for pair, reference in (settings or {}).items()}
        self.version = 0  #: counts changes, so a reader can tell when to look again

    def judge_revision(self, model: str, revision: str) -> str:
        """The revision whose reference judges ``revision``'s traces."""
        decision = self.decisions.get((model, revision))
        return decision.pinned_to if decision is not None and decision.pinned_to else revision

    def pinned_to(self, model: str, judged_by: str) -> set[str]:
        """The revisions of ``model`` that ``judged_by``'s reference judges (itself among them)."""
        return {judged_by} | {r for (m, r) in self.decisions if m == model and self.judge_revision(m, r) == judged_by}

    def in_force(self) -> dict[Revision, str]:
        """Every pin in force: pinned revision -> the revision whose reference judges it."""
        return {pair: d.pinned_to for pair, d in self.decisions.items() if d.pinned_to}

    def source(self, model: str, revision: str) -> str | None:
        decision = self.decisions.get((model, revision))
        return None if decision is None else decision.source

    def pin(self, model: str, revision: str, reference: str, at: float, source: str = "pin") -> None:
        """Judge ``revision`` by ``reference``'s reference from now on."""
        if reference == revision:
            raise ValueError("a revision cannot be pinned to itself; promote it instead")
        self._set((model, revision), Decision(reference, source, at))

    def promote(self, model: str, revision: str, at: float) -> None:
        """Make ``revision`` its own reference."""
        self._set((model, revision), Decision(None, "promote", at))

    def decide(self, model: str, revision: str, reference: str | None, at: float) -> bool:
        """A decision of the references topic (``reference`` None: a promotion); whether it
        took effect (one no later than the decision held, settings aside, changes nothing)."""
        current = self.decisions.get((model, revision))
        if current is not None and current.source != "settings" and current.at >= at:
            return False
        if reference is None:
            self.promote(model, revision, at)
        else:
            self.pin(model, revision, reference, at)
        return True

    def merge(self, saved: Iterable[Mapping[str, Any]]) -> None:
        """Decisions of a saved state (``to_list``): of two about a revision the later one
        holds, and any saved one overrides a pin from the settings."""
        for item in saved:
            pair = (str(item["model"]), str(item["revision"]))
            pinned = item["pinned_to"]
            other = Decision(None if pinned is None else str(pinned), str(item["source"]), float(item["at"]))
            mine = self.decisions.get(pair)
            if mine is None or mine.source == "settings" or other.at >= mine.at:
                self._set(pair, other)

    def to_list(self) -> list[dict[str, Any]]:
        """The decisions as JSON-able values (what :meth:`merge` takes)."""
        return [{"model": m, "revision": r, **d.to_dict()} for (m, r), d in self.decisions.items()]

    def _set(self, pair: Revision, decision: Decision) -> None:
        if self.decisions.get(pair) != decision:
            self.decisions[pair] = decision
            self.version += 1
