"""Who is served next: strict priority classes, fair share between tenants, FIFO per tenant.

Fairness follows the Virtual Token Counter (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024): each tenant has a counter of the tokens it was served divided
by its weight; the backlogged tenant with the smallest counter goes next. A tenant that
becomes backlogged is lifted to the smallest counter among the backlogged, so idling never
banks credit to flood with later. Pure data structure, no asyncio: the admission controller
drives it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any

MAX_TRACKED_TENANTS = 10_000


class QueueFullError(Exception):
    """The request's priority class is at its queue limit."""


@dataclasses.dataclass(eq=False)
class QueuedRequest:
    """One waiting request; ``payload`` is whatever the caller needs back when it is popped."""

    tenant: str
    priority: int  # class index, 0 = most urgent
    cost: int  # sequences it occupies when running (n)
    enqueued_at: float
    deadline: float
    payload: Any = None
    seq: int = 0


class FairQueue:
    """Bounded per-class queues of per-tenant FIFOs, popped by (class, tenant counter, arrival)."""

    def __init__(self, num_classes: int, max_per_class: int, weights: dict[str, float] | None = None,
                 default_weight: float = 1.0):
        if num_classes < 1:
            raise ValueError("at least one priority class is needed")
        self.max_per_class = max_per_class
        self.weights = dict(weights or {})
        self.default_weight = default_weight
        self._classes: list[dict[str, collections.deque[QueuedRequest]]] = [{} for _ in range(num_classes)]
        self._sizes = [0] * num_classes
        self.counters: dict[str, float] = collections.defaultdict(float)
        self._ids = itertools.count()

    def __len__(self) -> int:
        return sum(self._sizes)

    def depth(self, priority: int) -> int:
        return self._sizes[priority]

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    def push(self, item: QueuedRequest) -> None:
        if self._sizes[item.priority] >= self.max_per_class:
            raise QueueFullError(f"priority class {item.priority} already holds {self.max_per_class} waiting requests")
        if not self._backlogged(item.tenant):
            backlogged = [self.counters[t] for t in self._tenants() if t != item.tenant]
            if backlogged:
                self.counters[item.tenant] = max(self.counters[item.tenant], min(backlogged))
        item.seq = next(self._ids)
        self._classes[item.priority].setdefault(item.tenant, collections.deque()).append(item)
        self._sizes[item.priority] += 1

    def peek(self) -> QueuedRequest | None:
        """The request that goes next: most urgent class, least-served tenant, oldest request."""
        for tenants in self._classes:
            if tenants:
                tenant = min(tenants, key=lambda t: (self.counters[t], tenants[t][0].seq))
                return tenants[tenant][0]
        return None

    def pop(self) -> QueuedRequest | None:
        item = self.peek()
        if item is not None:
            self.remove(item)
        return item

    def remove(self, item: QueuedRequest) -> bool:
        """Take ``item`` out (dispatched, cancelled or expired); False if it was not queued."""
        tenants = self._classes[item.priority]
        fifo = tenants.get(item.tenant)
        if not fifo:
            return False
        try:
            fifo.remove(item)
        except ValueError:
            return False
        if not fifo:
            del tenants[item.tenant]
        self._sizes[item.priority] -= 1
        return True

    def charge(self, tenant: str, tokens: int) -> None:
        """Count ``tokens`` served to ``tenant`` (prompt tokens at dispatch, output as it streams)."""
        self.counters[tenant] += tokens / self.weight(tenant)
        if len(self.counters) > MAX_TRACKED_TENANTS:
            self._forget_idle()

    def _forget_idle(self) -> None:
        """Bound the counters (tenant names come from clients). An idle tenant whose counter is at
        or below every backlogged one's would be lifted to their minimum when it comes back, so
        forgetting it changes nothing; with nobody backlogged, the lower half is forgotten."""
        backlogged = self._tenants()
        floor = (min(self.counters[t] for t in backlogged) if backlogged
                 else sorted(self.counters.values())[len(self.counters) // 2])
        for tenant in [t for t, c in self.counters.items() if c <= floor and t not in backlogged]:
            del self.counters[tenant]

    def _tenants(self) -> set[str]:
        return {t for tenants in self._classes for t in tenants}

    def _backlogged(self, tenant: str) -> bool:
        return any(tenant in tenants for tenants in self._classes)
