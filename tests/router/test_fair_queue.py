"""router/fair_queue.py: strict priority between classes, fair share between tenants (virtual
token counters, weights, no banked credit for idle tenants), FIFO within a tenant, class limits."""

from __future__ import annotations

import pytest

from raylm.router import fair_queue, rate_limit
from raylm.router.fair_queue import FairQueue, QueuedRequest, QueueFullError
from raylm.router.rate_limit import RateLimiter


def _req(tenant: str, priority: int = 1, cost: int = 1, t: float = 0.0) -> QueuedRequest:
    return QueuedRequest(tenant, priority, cost, t, t + 60)


def _drain(queue: FairQueue, tokens_each: int = 0) -> list[str]:
    order = []
    while (item := queue.pop()) is not None:
        order.append(item.tenant)
        queue.charge(item.tenant, tokens_each)
    return order


def test_strict_priority_between_classes_and_fifo_within_a_tenant():
    queue = FairQueue(num_classes=3, max_per_class=10)
    low = [_req("a", 2) for _ in range(3)]
    high = [_req("a", 0) for _ in range(2)]
    for item in low + high:
        queue.push(item)
    assert [queue.pop() for _ in range(5)] == high + low


def test_least_served_tenant_goes_next():
    queue = FairQueue(num_classes=1, max_per_class=100)
    for _ in range(10):
        queue.push(_req("heavy", 0))
    for _ in range(2):
        queue.push(_req("light", 0))
    order = _drain(queue, tokens_each=100)
    # light is interleaved right away, not served after heavy's backlog
    assert order[:4].count("light") == 2


def test_weights_split_service_in_proportion():
    queue = FairQueue(num_classes=1, max_per_class=1000, weights={"gold": 3.0})
    for _ in range(400):
        queue.push(_req("gold", 0))
        queue.push(_req("basic", 0))
    served = _drain(queue, tokens_each=10)[:400]
    assert served.count("gold") / served.count("basic") == pytest.approx(3.0, rel=0.05)


def test_idle_tenant_banks_no_credit():
    """A tenant arriving after others were served starts at the backlog's minimum, not at 0."""
    queue = FairQueue(num_classes=1, max_per_class=100)
    for _ in range(20):
        queue.push(_req("a", 0))
        queue.push(_req("b", 0))
    for _ in range(20):
        item = queue.pop()
        queue.charge(item.tenant, 100)
    for _ in range(10):
        queue.push(_req("late", 0))
    order = _drain(queue, tokens_each=100)
    assert order[:9].count("late") <= 4  # shares with a and b instead of monopolising


def test_class_limit_and_removal():
    queue = FairQueue(num_classes=2, max_per_class=2)
    a, b = _req("x", 0), _req("y", 0)
    queue.push(a)
    queue.push(b)
    with pytest.raises(QueueFullError):
        queue.push(_req("z", 0))
    queue.push(_req("z", 1))  # the other class still has room
    assert queue.remove(a) and not queue.remove(a)
    assert queue.depth(0) == 1 and len(queue) == 2


# Covers both per-tenant tables a client can grow by naming new tenants: the fair queue's
# counters and the rate limiter's (router/rate_limit.py).
def test_tenants_named_by_clients_are_forgotten_when_idle():
    """A client may send a new ``user`` per request: per-tenant state must stay bounded."""
    clock = [0.0]
    limiter = RateLimiter(requests_per_minute=5, tokens_per_minute=None, clock=lambda: clock[0])
    for i in range(rate_limit.SWEEP_ABOVE_TENANTS + 1):
        limiter.check(f"user{i}")
    clock[0] = 61.0
    limiter.check("late")
    assert set(limiter._requests) == {"late"}

    queue = FairQueue(num_classes=1, max_per_class=10)
    queue.push(_req("busy", 0))
    queue.charge("busy", 10)
    for i in range(fair_queue.MAX_TRACKED_TENANTS):
        queue.charge(f"idle{i}", 1 + i % 20)  # below and above the backlogged tenant's counter
    kept = set(queue.counters) - {"busy"}
    assert len(queue.counters) <= fair_queue.MAX_TRACKED_TENANTS and "busy" in queue.counters
    assert kept and all(queue.counters[t] > 10 for t in kept)  # only the ones that would be lifted went
