"""What one admitted request holds, owned by a single object that gives it all back exactly once.

A request that passes admission holds run slots in the router and, once it is sent, worker
calls (each with KV blocks on its replica). Every exit path (success, client error, worker
error, disconnect, cancellation, a bug) must give both back, so neither is released by the
code paths themselves: the lease is closed in one ``finally`` that owns it (the endpoint's,
or the streaming response's once the endpoint has handed it over).
"""

from __future__ import annotations

from typing import AsyncGenerator, Callable, Protocol


class SlotOwner(Protocol):
    def release_lease(self, lease: "Lease") -> None: ...


class Lease:
    """Run slots granted to one request, plus the worker stream it feeds; ``close`` is idempotent."""

    def __init__(self, owner: SlotOwner, tenant: str, cost: int, on_tokens: Callable[[str, int], None],
                 waited_s: float = 0.0):
        self.owner = owner
        self.tenant = tenant
        self.cost = cost
        self._on_tokens = on_tokens
        self._stream: AsyncGenerator | None = None
        self.waited_s = waited_s  # time spent in the admission queue
        self.closed = False

    def count_tokens(self, tokens: int) -> None:
        """Served tokens count toward the tenant's fair share, rate limit and metrics."""
        if tokens:
            self._on_tokens(self.tenant, tokens)

    def attach(self, stream: AsyncGenerator) -> AsyncGenerator:
        """The worker stream this lease closes (cancelling its calls) when it is closed."""
        self._stream = stream
        return stream

    async def close(self) -> None:
        """Cancel the worker calls still running, then hand the slots back; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._stream is not None:
                await self._stream.aclose()
        finally:
            self.owner.release_lease(self)
