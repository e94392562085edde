"""Per-tenant rate limits over a sliding minute: requests/min and tokens/min, either optional."""

from __future__ import annotations

import collections
import time
from typing import Callable

from raylm.router.errors import OpenAIError

WINDOW_S = 60.0
SWEEP_ABOVE_TENANTS = 10_000


class RateLimiter:
    """Counts each tenant's requests and tokens of the last minute; refuses past a limit."""

    def __init__(self, requests_per_minute: int | None, tokens_per_minute: int | None,
                 clock: Callable[[], float] = time.monotonic):
        self.requests_per_minute = requests_per_minute
        self.tokens_per_minute = tokens_per_minute
        self.clock = clock
        self._requests: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self._tokens: dict[str, collections.deque[tuple[float, int]]] = collections.defaultdict(collections.deque)
        self._swept_at = float("-inf")

    def check(self, tenant: str) -> None:
        """Admit one request of ``tenant`` (counted) or raise a 429 with ``Retry-After``."""
        if not (self.requests_per_minute or self.tokens_per_minute):
            return  # no limits configured
        now = self.clock()
        if len(self._requests) > SWEEP_ABOVE_TENANTS and now - self._swept_at >= 1.0:
            self._swept_at = now
            self._forget_idle(now)
        requests, tokens = self._requests[tenant], self._tokens[tenant]
        while requests and requests[0] <= now - WINDOW_S:
            requests.popleft()
        while tokens and tokens[0][0] <= now - WINDOW_S:
            tokens.popleft()
        if self.requests_per_minute and len(requests) >= self.requests_per_minute:
            self._refuse(f"{self.requests_per_minute} requests per minute", requests[0] + WINDOW_S - now)
        if self.tokens_per_minute and sum(n for _, n in tokens) >= self.tokens_per_minute:
            self._refuse(f"{self.tokens_per_minute} tokens per minute", tokens[0][0] + WINDOW_S - now)
        requests.append(now)

    def _forget_idle(self, now: float) -> None:
        """Drop tenants with nothing in the window: tenant names come from clients (``user``), so
        remembering every one ever seen would grow without bound."""
        for table in (self._requests, self._tokens):
            for tenant in [t for t, entries in table.items() if not entries or _last_time(entries) <= now - WINDOW_S]:
                del table[tenant]

    def add_tokens(self, tenant: str, count: int) -> None:
        if self.tokens_per_minute and count:
            self._tokens[tenant].append((self.clock(), count))

    @staticmethod
    def _refuse(limit: str, retry_after_s: float) -> None:
        raise OpenAIError(429, f"rate limit reached: this tenant may use {limit}; retry later",
                          code="rate_limit_exceeded", headers={"Retry-After": str(max(1, int(retry_after_s + 0.999)))})


def _last_time(entries: collections.deque) -> float:
    last = entries[-1]
    return last[0] if isinstance(last, tuple) else last
