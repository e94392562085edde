"""The router's decision pieces without Ray: fair queue, admission, rate limits, API keys, replica choice."""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.metrics import MAX_TENANT_TAGS, RouterMetrics, tenant_tag
from router import fair_queue, rate_limit
from router.admission import AdmissionController
from router.auth import Authenticator, parse_api_keys
from router.errors import OpenAIError
from router.own_choice_mixin import OwnChoiceMixin
from router.fair_queue import FairQueue, QueuedRequest, QueueFullError
from router.prefix_policy import LOAD_IMBALANCE, NO_PREFIX, PREFIX_HIT, ReplicaView, choose_replica, matched_prefix
from router.rate_limit import RateLimiter
from router.routing_ledger import RoutingLedger


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


def test_tenant_tags_are_ascii_stable_and_bounded():
    assert tenant_tag("team-a") == "team-a"
    for hostile in ["josé", "😀", "a b", chr(0xD800), "x" * 65, ""]:
        tag = tenant_tag(hostile)
        assert tag.isascii() and tag.startswith("h-") and tag == tenant_tag(hostile)
    assert tenant_tag("josé") != tenant_tag("josé")
    metrics = RouterMetrics("m")
    tags = {metrics._tenant_tag(f"t{i}") for i in range(MAX_TENANT_TAGS + 50)}
    assert len(tags) == MAX_TENANT_TAGS + 1 and "other" in tags


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


def test_prefix_match_is_a_chain():
    assert matched_prefix([1, 2, 3, 4], {1, 2, 4}) == 2
    assert matched_prefix([9, 2], {2}) == 0
    assert matched_prefix([], {1}) == 0


def test_replica_choice_prefers_prefix_until_the_load_gap_is_too_big():
    rng = random.Random(0)
    views = [ReplicaView("a", 100, 0), ReplicaView("b", 900, 8)]
    assert choose_replica(views, 1000, rng) == (["b", "a"], PREFIX_HIT)
    assert choose_replica(views, 500, rng) == (["a", "b"], LOAD_IMBALANCE)
    assert choose_replica([ReplicaView("a", 5, 0), ReplicaView("b", 1, 0)], 500, rng) == (["b", "a"], NO_PREFIX)
    longest = [ReplicaView("a", 0, 2), ReplicaView("b", 10, 5), ReplicaView("c", 20, 5)]
    assert choose_replica(longest, 100, rng)[0][0] == "b"  # longest match, then least load
    assert choose_replica(longest, 15, rng)[0][0] == "b"  # "c" holds it too, but is too busy


def test_power_of_two_choices_never_picks_the_busiest_of_three():
    rng = random.Random(1)
    views = [ReplicaView("a", 0, 0), ReplicaView("b", 50, 0), ReplicaView("c", 999, 0)]
    picks = {choose_replica(views, 100, rng)[0][0] for _ in range(200)}
    assert picks == {"a", "b"}


def _route_burst(ledger: RoutingLedger, prompts: list[list[int]], threshold: int = 1000) -> list[str]:
    """Choose a replica for every prompt before any is accepted, as Serve does for a burst."""
    rng = random.Random(0)
    picks = []
    for i, hashes in enumerate(prompts):
        views = [ReplicaView(r, ledger.load(r), ledger.matched_blocks(r, hashes)) for r in ("a", "b")]
        ranked, reason = choose_replica(views, threshold, rng)
        ledger.choose(f"r{i}", ranked[0], 100, hashes, reason)
        picks.append(ranked[0])
    return picks


def test_a_burst_of_choices_is_spread_by_load_before_any_replica_accepts():
    ledger = RoutingLedger()
    picks = _route_burst(ledger, [[1000 + i] for i in range(16)])  # 16 distinct prefixes
    assert picks.count("a") == picks.count("b") == 8
    assert ledger.load("a") == ledger.load("b") == 800


def test_a_burst_sharing_a_prefix_sticks_to_one_replica_until_the_gap_is_too_big():
    ledger = RoutingLedger()
    picks = _route_burst(ledger, [[7, 8, 9]] * 12, threshold=450)
    assert picks[:5] == ["a"] * 5  # chosen for the prefix as soon as the first choice is recorded
    assert picks[5] == "b"  # "a" is 500 tokens ahead: spread
    assert ledger.matched_blocks("a", [7, 8, 9, 10]) == 3 and ledger.matched_blocks("b", [6, 7]) == 0


def test_acceptance_elsewhere_moves_the_charge_and_completion_releases_it():
    ledger = RoutingLedger()
    ledger.choose("r1", "a", 300, [5, 6], "prefix_hit")
    assert ledger.accepted("r1", "b", 300, [5, 6]) == ("a", "prefix_hit")  # "a" refused it
    assert (ledger.load("a"), ledger.load("b")) == (0, 300)
    assert ledger.matched_blocks("b", [5, 6]) == 2
    assert ledger.accepted("r2", "a", 40, []) == ("a", "fallback")  # never went through the policy
    ledger.release("r1")
    ledger.release("r2")
    ledger.release("r2")  # twice is harmless
    assert (ledger.load("a"), ledger.load("b"), ledger.in_flight()) == (0, 0, 0)


def test_calls_that_end_before_their_acceptance_is_reported_leave_no_charge():
    ledger = RoutingLedger()
    ledger.choose("refused", "a", 100, [], "no_prefix", ticket=1)
    ledger.release("refused", "a")  # "a" refused it: Serve reports the call ended, then retries
    assert (ledger.load("a"), ledger.in_flight()) == (0, 0)
    ledger.choose("refused", "b", 100, [], "no_prefix", ticket=1)
    assert ledger.accepted("refused", "b", 100, [], ticket=1) == ("b", "no_prefix")
    assert (ledger.load("b"), ledger.in_flight()) == (100, 1)
    ledger.choose("quick", "a", 70, [], "prefix_hit", ticket=2)
    ledger.release("quick", "a")  # cancelled by its client before the acceptance was processed
    assert ledger.accepted("quick", "a", 70, [], ticket=2) == ("a", "prefix_hit")  # late: ignored
    assert (ledger.load("a"), ledger.load("b"), ledger.in_flight()) == (0, 100, 1)


def test_choices_never_accepted_expire_and_accepted_ones_do_not():
    now = [0.0]
    ledger = RoutingLedger(pending_ttl_s=10, clock=lambda: now[0])
    ledger.choose("cancelled", "a", 100, [], "no_prefix")
    ledger.choose("running", "a", 50, [], "no_prefix")
    ledger.accepted("running", "a", 50, [])
    now[0] = 11.0
    ledger.choose("later", "b", 10, [], "no_prefix")  # choices expire lazily, on the next choice
    assert (ledger.load("a"), ledger.load("b"), ledger.in_flight()) == (50, 10, 2)


def test_a_choice_cancelled_while_routing_is_released_at_the_next_choice():
    gone = [False]
    ledger = RoutingLedger()
    ledger.choose("disconnected", "a", 100, [], "no_prefix", cancelled=lambda: gone[0])
    ledger.choose("other", "b", 10, [], "no_prefix")
    assert ledger.load("a") == 100
    gone[0] = True
    ledger.choose("next", "b", 10, [], "no_prefix")
    assert (ledger.load("a"), ledger.in_flight()) == (0, 2)


def test_a_dead_replica_is_forgotten():
    ledger = RoutingLedger()
    ledger.choose("r1", "a", 100, [1, 2], "no_prefix")
    ledger.forget_replica("a")
    assert (ledger.load("a"), ledger.matched_blocks("a", [1, 2]), ledger.in_flight()) == (0, 0, 0)


def test_sent_blocks_count_while_in_flight_then_for_a_grace_period_then_reports_decide():
    now = [0.0]
    ledger = RoutingLedger(report_grace_s=3, clock=lambda: now[0])
    ledger.choose("r1", "a", 10, [1, 2], "no_prefix")
    ledger.accepted("r1", "a", 10, [1, 2])
    now[0] = 100.0
    assert ledger.matched_blocks("a", [1, 2, 3]) == 2  # still running there, however long
    ledger.release("r1", "a")
    now[0] = 102.0
    assert ledger.matched_blocks("a", [1, 2]) == 2  # done, but the next report may not show it yet
    now[0] = 104.0
    assert ledger.matched_blocks("a", [1, 2]) == 0  # from here on the replica's own report says
    ledger.choose("r2", "b", 10, [1, 2], "no_prefix")
    ledger.accepted("r2", "a", 10, [1, 2])  # "b" refused it: it never computed the blocks
    ledger.release("r2", "a")
    assert ledger.matched_blocks("b", [1]) == 0 and ledger.matched_blocks("a", [1]) == 1


def test_the_block_record_is_bounded_oldest_first():
    ledger = RoutingLedger(max_tracked_blocks=3)
    ledger.choose("r1", "a", 1, [1, 2, 3], "no_prefix")
    ledger.choose("r2", "a", 1, [4], "no_prefix")
    assert ledger.matched_blocks("a", [1]) == 0 and ledger.matched_blocks("a", [2, 3, 4]) == 3


def test_calls_fanned_out_from_one_request_each_carry_their_own_charge():
    ledger = RoutingLedger()
    for ticket, replica in ((1, "a"), (2, "a"), (3, "b")):  # three prompts of one HTTP request
        ledger.choose("req", replica, 100, [], "no_prefix", ticket=ticket)
    for ticket, replica in ((1, "a"), (2, "b"), (3, "b")):
        ledger.accepted("req", replica, 100, [], ticket=ticket)
    assert (ledger.load("a"), ledger.load("b"), ledger.in_flight()) == (100, 200, 3)
    ledger.release("req", "b")
    assert (ledger.load("a"), ledger.load("b"), ledger.in_flight()) == (100, 100, 2)
    ledger.release("req", "a")
    ledger.release("req", "a")  # nothing of it left on "a": harmless
    assert (ledger.load("a"), ledger.load("b"), ledger.in_flight()) == (0, 100, 1)


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


class _OwnChoiceRouter(OwnChoiceMixin, _FakeRouterBase):
    pass


def test_a_replica_goes_to_the_request_it_was_chosen_for_not_the_oldest():
    async def scenario() -> dict[str, str]:
        oldest, newer, orphan = _Pending("oldest"), _Pending("newer"), _Pending("orphan")
        router = _OwnChoiceRouter([oldest, newer, orphan])

        async def routing_task(pending: _Pending, replica: str, delay: float) -> None:
            router.note_choice_for(pending)
            await asyncio.sleep(delay)
            router._fulfill_next_pending_request(replica)

        await asyncio.gather(routing_task(oldest, "replica-a", 0.02), routing_task(newer, "replica-b", 0.0))
        orphan.future.cancel()
        router._fulfill_next_pending_request("replica-c")  # no choice noted here: FIFO, skipping the cancelled
        return {p.name: p.future.result() for p in (oldest, newer)}

    assert asyncio.run(scenario()) == {"oldest": "replica-a", "newer": "replica-b"}


def test_a_replica_too_busy_to_answer_keeps_its_capacity(monkeypatch):
    """A long compile delays a replica's stats answer; admission capacity must not shrink for it."""
    from cluster import replicas

    names = ["SERVE_REPLICA::app#LLMWorker#a", "SERVE_REPLICA::app#LLMWorker#b", "SERVE_REPLICA::app#LLMWorker#new"]
    monkeypatch.setattr(replicas, "replica_actor_names", lambda app, deployment: names)
    monkeypatch.setattr(replicas, "_ask_replicas", lambda listed, timeout_s: {"a": {"running": 2}})
    previous = {"a": {"running": 1}, "b": {"running": 5}, "gone": {"running": 0}}
    polled = replicas.poll_replica_stats("app", "LLMWorker", previous)
    # a answered; b is busy and keeps its report; new never reported; gone is no longer listed
    assert polled == {"a": {"running": 2}, "b": {"running": 5}}


@pytest.mark.parametrize("count", [1, 3])
def test_closing_a_merged_stream_closes_every_source_at_once(count):
    """An abandoned worker stream must cancel its call when the response ends, not at garbage collection."""
    from router.streams import merge_indexed

    closed: list[int] = []

    async def source(index: int):
        try:
            for i in range(100):
                yield i
                await asyncio.sleep(0)
        finally:
            closed.append(index)

    async def main() -> None:
        sources = [source(i) for i in range(count)]
        merged = merge_indexed(sources)
        await anext(merged)
        await merged.aclose()
        assert sorted(closed) == list(range(count))

    asyncio.run(main())
