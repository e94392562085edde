"""Optional API keys: ``Authorization: Bearer KEY``; the key decides the tenant. Keys are never
logged or shown: the settings hold them in a ``Secret`` whose repr is masked."""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Mapping

from router.errors import OpenAIError


class Secret:
    """A value that does not print (logs, reprs of settings, tracebacks)."""

    def __init__(self, value: Mapping[str, str]):
        self._value = dict(value)

    def reveal(self) -> dict[str, str]:
        return self._value

    def __repr__(self) -> str:
        return f"Secret({len(self._value)} keys)"


def parse_api_keys(keys: list[str] | dict[str, str] | None, env_var: str | None) -> Secret:
    """``{key: tenant}`` from a config list (tenant derived from the key) or mapping, plus the
    comma-separated ``KEY`` or ``KEY=TENANT`` entries of the environment variable ``env_var``."""
    table: dict[str, str] = {}
    if isinstance(keys, dict):
        table.update({str(k): str(t) for k, t in keys.items()})
    else:
        table.update({k: _tenant_of(k) for k in keys or []})
    for entry in (os.environ.get(env_var, "") if env_var else "").split(","):
        entry = entry.strip()
        if entry:
            key, _, tenant = entry.partition("=")
            table[key] = tenant or _tenant_of(key)
    return Secret(table)


def _tenant_of(key: str) -> str:
    """A stable tenant name that does not reveal the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:10]


class Authenticator:
    """Maps a request's Authorization header to its tenant, or refuses it with 401."""

    def __init__(self, keys: Secret):
        self._keys = [(k.encode(), t) for k, t in keys.reveal().items()]

    def tenant(self, authorization: str | None) -> str | None:
        if not self._keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise OpenAIError(401, "missing API key: send 'Authorization: Bearer YOUR_KEY'", code="invalid_api_key")
        given = token.strip().encode()
        tenant = None
        for key, name in self._keys:  # compare with every key, in constant time each
            if hmac.compare_digest(given, key):
                tenant = name
        if tenant is None:
            raise OpenAIError(401, "incorrect API key provided", code="invalid_api_key")
        return tenant
