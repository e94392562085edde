"""router/admission.py: leases granted in fair-queue order as capacity frees, the queue deadline
(503) and a full class (429), and a cancelled waiter leaves no slot behind."""

from __future__ import annotations

import asyncio

import pytest

from raylm.router.admission import AdmissionController
from raylm.router.errors import OpenAIError
from raylm.router.fair_queue import FairQueue


def test_admission_grants_in_queue_order_as_capacity_frees():
    async def main() -> list[str]:
        queue = FairQueue(num_classes=3, max_per_class=10)
        admission = AdmissionController(queue, queue_timeout_s=5)
        admission.set_capacity(1)
        granted: list[str] = []

        leases = []

        async def client(name: str, priority: int) -> None:
            leases.append(await admission.acquire(name, priority, 1))
            granted.append(name)

        first = asyncio.create_task(client("first", 1))
        await asyncio.sleep(0)
        tasks = [asyncio.create_task(client(f"low{i}", 2)) for i in range(2)]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(client("high", 0)))
        await first
        for _ in range(3):
            await asyncio.sleep(0.01)
            await leases[-1].close()
        await asyncio.gather(*tasks)
        await leases[-1].close()
        assert admission.in_flight == 0
        return granted

    assert asyncio.run(main()) == ["first", "high", "low0", "low1"]


def test_admission_deadline_and_full_queue():
    async def main() -> None:
        queue = FairQueue(num_classes=1, max_per_class=1)
        admission = AdmissionController(queue, queue_timeout_s=0.2)
        admission.set_capacity(0)
        waiting = asyncio.create_task(admission.acquire("a", 0, 1))
        await asyncio.sleep(0.01)
        with pytest.raises(OpenAIError) as full:
            await admission.acquire("b", 0, 1)
        assert full.value.status == 429 and full.value.headers["Retry-After"]
        with pytest.raises(OpenAIError) as late:
            await waiting
        assert late.value.status == 503 and len(queue) == 0

    asyncio.run(main())


def test_cancelled_waiter_leaves_no_slot_behind():
    async def main() -> None:
        admission = AdmissionController(FairQueue(1, 10), queue_timeout_s=5)
        admission.set_capacity(1)
        lease = await admission.acquire("a", 0, 1)
        waiter = asyncio.create_task(admission.acquire("b", 0, 1))
        await asyncio.sleep(0.01)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        await lease.close()
        await lease.close()  # twice is harmless
        assert admission.in_flight == 0 and len(admission.queue) == 0 and not admission.leases

    asyncio.run(main())
