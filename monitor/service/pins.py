"""Pins that name a revision no contract has: a canary pinned by the wrong name is not
pinned at all.

A pin (``REFERENCE_PINS`` or ``attention-monitor reference pin``) is keyed by a model
revision as traces carry it. When the canary's traces carry another revision (the tap
names a revision from the loaded weights, ``contract derive`` from the files, or an
operator copied the wrong one), the canary learns its own reference from its own traffic
and is never judged by the pinned one: a silent failure. The service cannot tell a pin
made ahead of a deployment from a pin that names the wrong revision, so it reports every
pin whose revision no known contract has, loudly and from the moment it is seen:

- ``attention_monitor_pin_unmatched{model, revision, reference}`` is 1 while it lasts
  (the ``AttentionPinUnmatched`` alert fires after 30 minutes; ``status`` lists it);
- a warning in the log when the service starts or the pin is made, and again, naming
  them, when other revisions of the same model arrive: most likely the canary itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from monitor.core.pins import Pins, Revision
from monitor.protocol.decisions import ReferenceTable
from monitor.protocol.model_contract import ContractTable

log = logging.getLogger(__name__)

def follow(rule: Pins, table: ReferenceTable, version: int) -> int:
    """Apply the references topic's decisions after ``version`` to ``rule``, in order,
    as the judge applies them (:meth:`Pins.decide`); the table's version now."""
    for d in table.since(version):
        rule.decide(d.model_id, d.revision, d.reference if d.action == "pin" else None, d.at)
    return table.version


@dataclass
class PinCheck:
    """Finds the pins whose revision no contract has, and says so once per change."""

    rule: Pins  #: the pins in force: the same rule routing and judging follow
    unmatched: dict[Revision, str] = field(default_factory=dict)  #: pinned revision → its reference
    _versions: tuple[int, int] = (-1, -1)
    _told: dict[Revision, frozenset[str]] = field(default_factory=dict)  #: the other revisions last named

    def check(self, contracts: ContractTable) -> tuple[dict[Revision, str], dict[Revision, str]]:
        """(pins that became unmatched, pins that stopped being) since the last call;
        nothing is worked out when neither the contracts nor the pins changed."""
        versions = (contracts.version, self.rule.version)
        if versions == self._versions:
            return {}, {}
        self._versions = versions
        known = {(c.model_id, c.model_revision) for c in contracts.contracts()}
        now = {pair: reference for pair, reference in self.rule.in_force().items() if pair not in known}
        began = {pair: ref for pair, ref in now.items() if self.unmatched.get(pair) != ref}
        ended = {pair: ref for pair, ref in self.unmatched.items() if now.get(pair) != ref}
        self.unmatched = now
        for pair in ended:
            self._told.pop(pair, None)
        self._warn(now, known)
        return began, ended

    def _warn(self, unmatched: dict[Revision, str], known: Iterable[Revision]) -> None:
        for (model, revision), reference in sorted(unmatched.items()):
            others = frozenset(r for m, r in known if m == model and r not in (revision, reference))
            if (model, revision) in self._told and self._told[(model, revision)] == others:
                continue
            self._told[(model, revision)] = others
            if others:
                log.warning("%s is pinned to the reference of %s under revision %s, which no contract has, while "
                            "contracts of %s arrive for %s: if one of those is the revision you meant to pin, it "
                            "is not pinned and learns its own reference from its own traffic. Pin the revision "
                            "its traces carry (attention-monitor status lists them)", model, reference, revision,
                            model, ", ".join(sorted(others)))
            else:
                log.warning("%s is pinned to the reference of %s under revision %s, which no contract has yet: "
                            "fine ahead of a deployment; if that revision is serving already, its traces carry "
                            "another revision and the pin does nothing", model, reference, revision)
