"""Per-tenant rate limits over a sliding minute: requests/min and tokens/min, either optional."""

from __future__ import annotations

import collections
import time
from typing import Callable

from router.errors import OpenAIError

WINDOW_S = 60.0


class RateLimiter:
    """Counts each tenant's requests and tokens of the last minute; refuses past a limit."""

    def __init__(self, requests_per_minute: int | None, tokens_per_minute: int | None,
                 clock: Callable[[], float] = time.monotonic):
        self.requests_per_minute = requests_per_minute
        self.tokens_per_minute = tokens_per_minute
        self.clock = clock
        self._requests: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self._tokens: dict[str, collections.deque[tuple[float, int]]] = collections.defaultdict(collections.deque)

    @property
    def enabled(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute)

    def check(self, tenant: str) -> None:
        """Admit one request of ``tenant`` (counted) or raise a 429 with ``Retry-After``."""
        now = self.clock()
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

    def add_tokens(self, tenant: str, count: int) -> None:
        if self.tokens_per_minute and count:
            self._tokens[tenant].append((self.clock(), count))

    @staticmethod
    def _refuse(limit: str, retry_after_s: float) -> None:
        raise OpenAIError(429, f"rate limit reached: this tenant may use {limit}; retry later",
                          code="rate_limit_exceeded", headers={"Retry-After": str(max(1, int(retry_after_s + 0.999)))})
