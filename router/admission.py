"""Admission control: requests wait in the router's fair queue until the workers have room.

The router lets at most ``capacity`` sequences run at once (the worker replicas' batch slots,
read from their routing stats), so the order in which work starts is decided here, by
priority and fairness, rather than first come first served in the replicas' queues. A full
class answers at once (429); a request that waits past its deadline gets 503.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from raylm.router.errors import OpenAIError
from raylm.router.fair_queue import FairQueue, QueuedRequest, QueueFullError
from raylm.router.lease import Lease


class AdmissionController:
    """Grants run slots to waiting requests in ``FairQueue`` order, as leases it keeps track of."""

    def __init__(self, queue: FairQueue, queue_timeout_s: float, retry_after_s: int = 1,
                 clock: Callable[[], float] = time.monotonic,
                 on_tokens: Callable[[str, int], None] = lambda tenant, tokens: None):
        self.queue = queue
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.on_tokens = on_tokens
        self.capacity = 0
        self.leases: set[Lease] = set()
        self._granted = 0  # slots granted to waiters whose lease is not made yet

    @property
    def in_flight(self) -> int:
        """Slots held right now: the ledger that must return to zero once requests are done."""
        return self._granted + sum(lease.cost for lease in self.leases)

    async def acquire(self, tenant: str, priority: int, cost: int) -> Lease:
        """Wait for slots and return their lease (``waited_s`` says how long it queued).
        Raises OpenAIError 429 (queue full) / 503 (waited too long)."""
        now = self.clock()
        loop = asyncio.get_running_loop()
        item = QueuedRequest(tenant, priority, cost, now, now + self.queue_timeout_s, loop.create_future())
        try:
            self.queue.push(item)
        except QueueFullError as err:
            raise OpenAIError(429, f"too many requests are waiting: {err}; retry later", code="queue_full",
                              headers={"Retry-After": str(self.retry_after_s)}) from None
        self._dispatch()
        try:
            await asyncio.wait_for(asyncio.shield(item.payload), self.queue_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as err:
            if not self.queue.remove(item):  # granted in the meantime: hand the slot back
                self._granted -= cost
                self._dispatch()
            if isinstance(err, asyncio.CancelledError):
                raise
            raise OpenAIError(503, f"the request waited {self.queue_timeout_s:.0f} s in the queue without "
                              "being scheduled; the server is overloaded, retry later", code="queue_timeout",
                              headers={"Retry-After": str(self.retry_after_s)}) from None
        # No await between here and the caller's ``try``: the lease cannot be lost in between.
        self._granted -= cost
        lease = Lease(self, tenant, cost, self.on_tokens, waited_s=self.clock() - now)
        self.leases.add(lease)
        return lease

    def release_lease(self, lease: Lease) -> None:
        """A granted request finished (or failed): its slots go to the next in line."""
        if lease in self.leases:
            self.leases.remove(lease)
            self._dispatch()

    def set_capacity(self, capacity: int) -> None:
        self.capacity = capacity
        self._dispatch()

    def _dispatch(self) -> None:
        while True:
            item = self.queue.peek()
            if item is None:
                return
            # A request bigger than the whole capacity still runs, alone.
            if self.in_flight + item.cost > self.capacity and not (self.in_flight == 0 and self.capacity > 0):
                return
            self.queue.remove(item)
            self._granted += item.cost
            item.payload.set_result(None)
