"""router/auth.py: API keys map to tenants (from settings and the environment), everything else
is a 401 that never echoes a key."""

from __future__ import annotations

import pytest

from raylm.router.auth import Authenticator, parse_api_keys
from raylm.router.errors import OpenAIError


def test_api_keys_map_to_tenants_and_refuse_others(monkeypatch):
    monkeypatch.setenv("TEST_KEYS", "sk-env=envtenant, sk-anon")
    keys = parse_api_keys({"sk-alice": "alice"}, "TEST_KEYS")
    assert "sk-alice" not in repr(keys)
    auth = Authenticator(keys)
    assert auth.tenant("Bearer sk-alice") == "alice"
    assert auth.tenant("Bearer sk-env") == "envtenant"
    assert auth.tenant("bearer sk-anon").startswith("key-")
    for header in (None, "Bearer ", "Basic sk-alice", "Bearer sk-wrong"):
        with pytest.raises(OpenAIError) as err:
            auth.tenant(header)
        assert err.value.status == 401 and "sk-" not in err.value.message
    assert Authenticator(parse_api_keys([], None)).tenant(None) is None
