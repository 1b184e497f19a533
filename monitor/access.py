"""Who may sign traces (the keyring) and whose traces this monitor may process (scopes)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from monitor.errors import ConfigurationError
from monitor.schema import Scope

WILDCARD = "*"


@dataclass(frozen=True)
class Keyring:
    """Key id → HMAC secret. ``repr`` never shows a secret."""

    keys: Mapping[str, bytes] = field(repr=False)

    def __post_init__(self) -> None:
        for key_id, secret in self.keys.items():
            if not key_id or len(key_id.encode()) > 255:
                raise ConfigurationError(f"key id {key_id!r} must be 1-255 bytes")
            if len(secret) < 16:
                raise ConfigurationError(f"secret of key {key_id!r} is shorter than 16 bytes")

    def secret(self, key_id: str) -> bytes | None:
        return self.keys.get(key_id)

    def __repr__(self) -> str:
        return f"Keyring(key_ids={sorted(self.keys)})"

    @classmethod
    def from_json(cls, text: str, where: str = "keyring") -> Keyring:
        """A JSON object ``{"key-id": "secret", ...}`` (secrets as UTF-8 text)."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigurationError(f"{where} is not JSON: {exc}") from exc
        if not isinstance(doc, dict) or not all(isinstance(v, str) for v in doc.values()):
            raise ConfigurationError(f"{where} must be a JSON object of key id to secret string")
        return cls({k: v.encode() for k, v in doc.items()})

    @classmethod
    def from_file(cls, path: Path) -> Keyring:
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigurationError(f"cannot read keyring {path}: {exc.strerror}") from exc
        return cls.from_json(text, f"keyring {path}")


@dataclass(frozen=True)
class ScopePolicy:
    """The (tenant, data class) pairs this monitor may process; ``*`` matches any."""

    allowed: frozenset[tuple[str, str]]

    @classmethod
    def parse(cls, entries: Iterable[str]) -> ScopePolicy:
        """From ``tenant:data_class`` strings, e.g. ``acme:internal``, ``*:public``."""
        pairs = set()
        for entry in entries:
            tenant, sep, data_class = entry.partition(":")
            if not sep or not tenant or not data_class:
                raise ConfigurationError(f"scope {entry!r} must be tenant:data_class (either may be *)")
            pairs.add((tenant, data_class))
        return cls(frozenset(pairs))

    def permits(self, scope: Scope) -> bool:
        return any(
            t in (WILDCARD, scope.tenant) and d in (WILDCARD, scope.data_class) for t, d in self.allowed
        )
