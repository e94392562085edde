"""router/prefix_router.py inside Serve's own routing loop (its ``RequestRouter`` with in-memory
replicas): the replica the policy prefers keeps the request when it is merely slow to answer
Serve's queue-length probe, and loses it only when it does not answer at all."""

from __future__ import annotations

import asyncio
import uuid

from ray.serve._private.common import DeploymentHandleSource, RequestMetadata
from ray.serve._private.test_utils import FAKE_REPLICA_DEPLOYMENT_ID, FakeRunningReplica
from ray.serve.request_router import PendingRequest

from raylm.cache.block_pool import PoolStats
from raylm.router.prefix_router import PrefixAwareRequestRouter
from raylm.workers.core.engine_stats import EngineStats
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.wire.replica_protocol import GenerateRequest, RoutingReport


class _Replica(FakeRunningReplica):
    """Reports nothing yet: the router goes by its own ledger."""

    @property
    def routing_stats(self) -> dict:
        return {}


def _pending(max_tokens: int, block_hashes: list[int] | None = None) -> PendingRequest:
    request_id = uuid.uuid4().hex
    request = GenerateRequest(request_id, list(range(40)), SamplingParams(max_tokens=max_tokens),
                              block_hashes=block_hashes or [hash((request_id, 0)), hash((request_id, 1))])
    return PendingRequest(args=[request], kwargs={},
                          metadata=RequestMetadata(request_id=request_id, internal_request_id=request_id))


def _router(imbalance_threshold_tokens: int = 2048) -> PrefixAwareRequestRouter:
    router = PrefixAwareRequestRouter(FAKE_REPLICA_DEPLOYMENT_ID, DeploymentHandleSource.UNKNOWN,
                                      use_replica_queue_len_cache=True)
    router.initialize_state(block_size=16, imbalance_threshold_tokens=imbalance_threshold_tokens)
    return router


def _running(router: PrefixAwareRequestRouter, replica: _Replica, tokens: int, block_hashes: list[int],
             queue_known: bool = True) -> None:
    """``replica`` runs a request of ``tokens`` this router sent it; ``queue_known``: Serve has
    its queue length cached (else it probes the replica before sending it anything)."""
    request_id = uuid.uuid4().hex
    router.ledger.choose(request_id, replica.replica_id, tokens, block_hashes, "no_prefix")
    router.ledger.accepted(request_id, replica.replica_id, tokens, block_hashes)
    if queue_known:
        router._replica_queue_len_cache.update(replica.replica_id, 1)


async def _timed_choice(router: PrefixAwareRequestRouter, pending: PendingRequest) -> tuple[str, float]:
    loop = asyncio.get_running_loop()
    started = loop.time()
    chosen = await asyncio.wait_for(router._choose_replica_for_request(pending), 10)
    return chosen.replica_id.unique_id, loop.time() - started


async def _route_beside_a_busy_replica(idle_probe_delay_s: float | None) -> tuple[str, float]:
    """One replica runs a long request; a new prompt arrives. Returns where it went and how
    long routing took. ``idle_probe_delay_s`` None: the idle replica never answers."""
    router = _router()
    busy, idle = _Replica("busy"), _Replica("idle", sleep_time_s=idle_probe_delay_s or 0.0)
    busy.set_queue_len_response(1)
    if idle_probe_delay_s is not None:
        idle.set_queue_len_response(0)
    router.update_replicas([busy, idle])
    _running(router, busy, 540, [])
    return await _timed_choice(router, _pending(max_tokens=8))


def test_a_preferred_replica_slow_to_answer_its_probe_still_gets_the_request():
    # Serve's first probe deadline is 0.1 s: a replica answering in 0.15 s (a busy host) used to
    # lose the request to the next in rank, the busy one, though it was idle.
    replica, _ = asyncio.run(_route_beside_a_busy_replica(idle_probe_delay_s=0.15))
    assert replica == "idle"


def test_a_preferred_replica_that_never_answers_loses_the_request_within_a_second():
    replica, seconds = asyncio.run(_route_beside_a_busy_replica(idle_probe_delay_s=None))
    assert replica == "busy"
    assert seconds < 1.0


def test_a_request_asked_about_again_does_not_weigh_on_its_own_choice():
    async def scenario() -> str:
        # "home" holds the prompt's two blocks and runs 100 tokens, 10 under the threshold above
        # the idle "other"; the new request adds 8 + 8 tokens. Its first offer misses home's
        # probe: asked again, home must still be within the threshold (without counting the
        # request's own charge from the first offer).
        router = _router(imbalance_threshold_tokens=110)
        home, other = _Replica("home", sleep_time_s=0.15), _Replica("other")
        home.set_queue_len_response(1)
        other.set_queue_len_response(0)
        router.update_replicas([home, other])
        _running(router, home, 100, [11, 12], queue_known=False)
        replica, _ = await _timed_choice(router, _pending(max_tokens=8, block_hashes=[11, 12]))
        return replica

    assert asyncio.run(scenario()) == "home"


class _Reporting(FakeRunningReplica):
    """Reports its load, the blocks its pool caches and those it knows a shared KV tier holds."""

    def __init__(self, name: str, work_tokens: int, cached: list[int], shared: list[int]):
        super().__init__(name)
        pool = PoolStats(num_free_blocks=8, num_used_blocks=0, num_cached_blocks=0, num_usable_blocks=8, usage=0.0,
                         prefix_queries=0, prefix_hits=0)
        stats = EngineStats(running=0, waiting=0, waiting_tokens=0, work_tokens=work_tokens, tokens_stored=0,
                            token_capacity=0, num_preemptions=0, requests=0, prompt_tokens=0, generation_tokens=0,
                            pool=pool)
        self._report = RoutingReport(stats, "node", cached, shared_hashes=shared).as_dict()

    @property
    def routing_stats(self) -> dict:
        return self._report


async def _choose_between_holder_and_idle(shared: list[int]) -> str:
    prefix = [11, 12, 13]
    router = _router(imbalance_threshold_tokens=2048)
    holder, idle = _Reporting("holder", 1500, prefix, shared), _Reporting("idle", 0, [], [])
    for replica in (holder, idle):
        replica.set_queue_len_response(0)
    router.update_replicas([holder, idle])
    chosen, _ = await _timed_choice(router, _pending(max_tokens=8, block_hashes=prefix))
    return chosen


def test_a_prefix_the_cluster_tier_holds_goes_to_the_less_loaded_replica():
    assert asyncio.run(_choose_between_holder_and_idle(shared=[])) == "holder"  # only its pool has it
    assert asyncio.run(_choose_between_holder_and_idle(shared=[11, 12, 13])) == "idle"  # any replica loads it
