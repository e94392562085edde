"""Optional API keys: ``Authorization: Bearer KEY``; the key decides the tenant. Admin keys
may also load and unload LoRA adapters (vLLM's ``/v1/load_lora_adapter``); once any key is
configured, only they may. Keys are never logged or shown: the settings hold them in a
``Secret`` whose repr is masked."""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Mapping

from raylm.router.errors import OpenAIError


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


def with_env_keys(keys: Secret, env_var: str | None) -> Secret:
    """The deploy file's ``keys`` and those of the environment variable ``env_var``, read in this
    replica's process (where the secret was set)."""
    return Secret({**keys.reveal(), **parse_api_keys(None, env_var).reveal()})


def _tenant_of(key: str) -> str:
    """A stable tenant name that does not reveal the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:10]


class Authenticator:
    """Maps a request's Authorization header to its tenant, or refuses it with 401; admin
    endpoints take admin keys only (403 for another valid key)."""

    def __init__(self, keys: Secret, admin_keys: Secret = Secret({})):
        self._admin = [k.encode() for k in admin_keys.reveal()]
        # An admin key is a key of its own tenant on every other endpoint too.
        table = {**{k: _tenant_of(k) for k in admin_keys.reveal()}, **keys.reveal()}
        self._keys = [(k.encode(), t) for k, t in table.items()]

    def tenant(self, authorization: str | None) -> str | None:
        if not self._keys:
            return None
        return _match(_bearer(authorization), self._keys)

    def admin(self, authorization: str | None) -> None:
        """Allow an admin request: anyone when no key is configured, else an admin key's holder."""
        if not self._keys:
            return
        given = _bearer(authorization)
        if _match(given, [(k, "admin") for k in self._admin], required=False) is None:
            _match(given, self._keys)  # 401 for a key that is no key at all
            raise OpenAIError(403, "this API key may not load or unload LoRA adapters: send an admin key "
                              "(router.admin_api_keys)", code="permission_denied")


def _bearer(authorization: str | None) -> bytes:
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise OpenAIError(401, "missing API key: send 'Authorization: Bearer YOUR_KEY'", code="invalid_api_key")
    return token.strip().encode()


def _match(given: bytes, keys: list[tuple[bytes, str]], required: bool = True) -> str | None:
    """The tenant of the key ``given`` is, comparing with every key in constant time each; a
    401 (or None when not ``required``) when it is none of them."""
    tenant = None
    for key, name in keys:
        if hmac.compare_digest(given, key):
            tenant = name
    if tenant is None and required:
        raise OpenAIError(401, "incorrect API key provided", code="invalid_api_key")
    return tenant
