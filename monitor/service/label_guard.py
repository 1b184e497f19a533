"""Bounded model and revision label values: an allow-list of model ids when configured,
otherwise the first ``max_model_revisions`` distinct (model, revision) pairs; anything
else is labelled ``other``/``other`` (and counted in
``attention_monitor_label_overflow_total`` by :mod:`monitor.service.exporter`)."""

from __future__ import annotations

from dataclasses import dataclass, field

OTHER = "other"


@dataclass
class LabelGuard:
    """Bounds the model/revision label values."""

    max_pairs: int
    allowlist: frozenset[str] = frozenset()
    _seen: set[tuple[str, str]] = field(default_factory=set)

    def labels(self, model: str, revision: str) -> tuple[str, str] | None:
        """The label pair to use, or None when it overflows into ``other``."""
        if self.allowlist:
            return (model, revision) if model in self.allowlist and self._admit(model, revision) else None
        return (model, revision) if self._admit(model, revision) else None

    def _admit(self, model: str, revision: str) -> bool:
        pair = (model, revision)
        if pair in self._seen:
            return True
        if len(self._seen) >= self.max_pairs:
            return False
        self._seen.add(pair)
        return True
