"""router/chosen_request_mixin.py: a replica found by a routing task goes to the request it was chosen
for, not to the oldest waiting one."""

from __future__ import annotations

import asyncio

from raylm.router.chosen_request_mixin import ChosenRequestMixin


class _Pending:
    def __init__(self, name: str):
        self.name, self.created_at, self.future = name, 0.0, asyncio.get_running_loop().create_future()


class _FakeRouterBase:
    """What ``FIFOMixin`` expects of the ``RequestRouter`` it is composed with."""

    def __init__(self, pending: list[_Pending]):
        import collections

        self._pending_requests_to_fulfill = collections.deque(pending)

    def _record_queue_wait_time(self, pending_request) -> None:
        pass

    def _remove_pending_request_from_indices(self, pending_request) -> None:
        pass

    def _cancel_routing_task_for_pending_request(self, pending_request) -> None:
        pass


class _ChosenRequestRouter(ChosenRequestMixin, _FakeRouterBase):
    pass


def test_a_replica_goes_to_the_request_it_was_chosen_for_not_the_oldest():
    async def scenario() -> dict[str, str]:
        oldest, newer, orphan = _Pending("oldest"), _Pending("newer"), _Pending("orphan")
        router = _ChosenRequestRouter([oldest, newer, orphan])

        async def routing_task(pending: _Pending, replica: str, delay: float) -> None:
            router.note_choice_for(pending)
            await asyncio.sleep(delay)
            router._fulfill_next_pending_request(replica)

        await asyncio.gather(routing_task(oldest, "replica-a", 0.02), routing_task(newer, "replica-b", 0.0))
        orphan.future.cancel()
        router._fulfill_next_pending_request("replica-c")  # no choice noted here: FIFO, skipping the cancelled
        return {p.name: p.future.result() for p in (oldest, newer)}

    assert asyncio.run(scenario()) == {"oldest": "replica-a", "newer": "replica-b"}
