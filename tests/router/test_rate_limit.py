"""router/rate_limit.py: per-tenant requests/min and tokens/min with Retry-After. (That its
per-tenant table stays bounded is checked with the fair queue's, in test_fair_queue.py.)"""

from __future__ import annotations

import pytest

from raylm.router.errors import OpenAIError
from raylm.router.rate_limit import RateLimiter


def test_rate_limits_per_tenant_with_retry_after():
    now = [0.0]
    limiter = RateLimiter(requests_per_minute=2, tokens_per_minute=100, clock=lambda: now[0])
    limiter.check("a")
    limiter.check("a")
    with pytest.raises(OpenAIError) as err:
        limiter.check("a")
    assert err.value.status == 429 and int(err.value.headers["Retry-After"]) == 60
    limiter.check("b")  # another tenant is unaffected
    limiter.add_tokens("b", 150)
    with pytest.raises(OpenAIError):
        limiter.check("b")
    now[0] = 61.0
    limiter.check("a")
    limiter.check("b")
