"""Who may sign traces and contracts (the keyring: each key bound to its tenants, and
allowed to publish contracts or not) and whose traces this monitor may process (scopes)."""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from monitor.errors import ConfigurationError
from monitor.protocol.model_contract import Verifier, contract_signature
from monitor.protocol.schema import Scope

WILDCARD = "*"


@dataclass(frozen=True)
class Key:
    """One signing key: its secret, the tenants whose traces it may sign, and whether it
    may publish model contracts."""

    secret: bytes = field(repr=False)
    tenants: frozenset[str] = frozenset({WILDCARD})
    contracts: bool = False
    legacy: bool = False  #: written as a bare secret: any tenant, contracts allowed

    def may_sign(self, tenant: str) -> bool:
        return WILDCARD in self.tenants or tenant in self.tenants


@dataclass(frozen=True)
class Keyring:
    """Key id → :class:`Key`. ``repr`` never shows a secret. A bare ``bytes`` value (or a
    string in the JSON form) is a legacy key: it may sign any tenant and publish
    contracts; ``check-config`` warns about it."""

    keys: Mapping[str, Key | bytes] = field(repr=False)

    def __post_init__(self) -> None:
        normal = {k: v if isinstance(v, Key) else Key(v, frozenset({WILDCARD}), True, legacy=True)
                  for k, v in self.keys.items()}
        object.__setattr__(self, "keys", normal)
        for key_id, key in normal.items():
            if not key_id or len(key_id.encode()) > 255:
                raise ConfigurationError(f"key id {key_id!r} must be 1-255 bytes")
            if len(key.secret) < 16:
                raise ConfigurationError(f"secret of key {key_id!r} is shorter than 16 bytes")
            if not key.tenants:
                raise ConfigurationError(f"key {key_id!r} may sign no tenant")

    def key(self, key_id: str) -> Key | None:
        key = self.keys.get(key_id)
        return key if isinstance(key, Key) else None

    def secret(self, key_id: str) -> bytes | None:
        key = self.key(key_id)
        return None if key is None else key.secret

    @property
    def legacy(self) -> list[str]:
        """Key ids bound to no tenant (the bare-secret form)."""
        return sorted(k for k, v in self.keys.items() if isinstance(v, Key) and v.legacy)

    def __repr__(self) -> str:
        return f"Keyring(key_ids={sorted(self.keys)})"

    @classmethod
    def from_json(cls, text: str, where: str = "keyring") -> Keyring:
        """A JSON object of key id to ``{"secret": "...", "tenants": ["team-a"],
        "contracts": true}`` (or, the legacy form, to the secret string)."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigurationError(f"{where} is not JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise ConfigurationError(f"{where} must be a JSON object of key id to key")
        keys: dict[str, Key | bytes] = {}
        for key_id, entry in doc.items():
            if isinstance(entry, str):
                keys[key_id] = entry.encode()
                continue
            tenants = entry.get("tenants") if isinstance(entry, dict) else None
            if (not isinstance(entry, dict) or not isinstance(entry.get("secret"), str) or not isinstance(tenants, list)
                    or not all(isinstance(t, str) and t for t in tenants)
                    or not isinstance(entry.get("contracts", False), bool)):
                raise ConfigurationError(f"{where}: key {key_id!r} must be {{\"secret\": \"...\", \"tenants\": "
                                         f"[\"tenant\", ...], \"contracts\": true|false}}")
            keys[key_id] = Key(entry["secret"].encode(), frozenset(tenants), bool(entry.get("contracts", False)))
        return cls(keys)

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


def contract_verifier(keyring: Keyring) -> Verifier:
    """Accepts a contract record signed by a key of ``keyring`` allowed to publish contracts."""

    def verify(key_id: str | None, signature: str | None, contract_id: str) -> str | None:
        if key_id is None or signature is None:
            return "unsigned"
        key = keyring.key(key_id)
        if key is None:
            return "unknown_key"
        if not key.contracts:
            return "not_allowed"
        if not hmac.compare_digest(signature, contract_signature(contract_id, key.secret)):
            return "bad_signature"
        return None

    return verify
