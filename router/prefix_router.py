"""A Ray Serve ``RequestRouter`` for the worker deployment that prefers the replica already
holding the prompt's prefix in its KV cache.

What a replica holds comes from two sources: its routing stats (the hashes of its cached
blocks, refreshed every ``request_routing_stats_period_s``) and this router's ledger of which
prompts it sent where (immediate, so a burst sharing a prefix sticks to one replica before
the next stats report; kept only until the reports can show it, so evictions are seen).

Load is work left in tokens: prompt tokens not yet computed (a cached prefix is free) plus
the outputs ``max_tokens`` still allows. It is the larger of what the replica reports and
what this router has in flight there, charged the moment the replica is chosen.

Each chosen replica goes to the request it was chosen for (``ChosenRequestMixin``), and the
ledger follows what was actually accepted, so loads stay right when a replica refuses one.

Serve probes the replicas it is offered for their queue length, with a 0.1 s deadline at first,
and moves down the ranking past any that miss it. A replica whose host is busy (the other
replica's prefill on the same cores, a big batch) misses that deadline while perfectly able to
serve, and the request would go to the next in rank: a cache miss, or the busy replica. So the
first offer for a request is the preferred replica alone; the next (Serve asks again at once,
its deadline doubled) is the whole ranking, so a replica that does not answer at all costs
0.3 s, not the request.
"""

from __future__ import annotations

import random
import weakref
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from raylm.router.chosen_request_mixin import ChosenRequestMixin
from raylm.router.prefix_policy import ReplicaView, choose_replica, matched_prefix
from raylm.router.routing_ledger import RoutingLedger
from raylm.workers.wire.replica_protocol import GenerateRequest, RoutingReport


class PrefixAwareRequestRouter(ChosenRequestMixin, RequestRouter):
    def initialize_state(self, *, block_size: int, imbalance_threshold_tokens: int = 2048,
                         max_tracked_blocks: int = 200_000, report_grace_s: float = 3.0, model: str = "",
                         seed: int | None = None) -> None:
        """Serve passes the deployment's ``request_router_kwargs``; ``block_size`` is the workers'
        (their engine's), since cached prefixes are counted in its blocks."""
        self.imbalance_threshold_tokens = imbalance_threshold_tokens
        self.block_size = block_size
        self.rng = random.Random(seed)
        self.ledger = RoutingLedger(max_tracked_blocks, report_grace_s=report_grace_s)
        # Per replica: its latest routing-stats dict (by identity), parsed, and its hashes (cached,
        # and held by a shared KV tier) as sets.
        self._reported: dict[ReplicaID, tuple[dict, RoutingReport, frozenset[int], frozenset[int]]] = {}
        # The routing attempts (by their future, new on a retry) offered their first choice alone.
        self._offered_first_alone: weakref.WeakSet = weakref.WeakSet()
        from raylm.cluster.metrics import RouterMetrics

        self.metrics = RouterMetrics(model)

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = _generate_request(pending_request)
        if request is not None:
            self.ledger.withdraw(id(pending_request))
        hashes = request.block_hashes if request is not None else []
        by_id = {r.replica_id: r for r in candidate_replicas}
        adapter = request.lora.lora_name if request is not None and request.lora is not None else None
        shared = self._shared(candidate_replicas, hashes)
        views = [ReplicaView(r.replica_id, self._load(r), self._matched(r, hashes), self._holds(r, adapter), shared)
                 for r in candidate_replicas]
        ranked, reason = choose_replica(views, self.imbalance_threshold_tokens, self.rng)
        self.note_choice_for(pending_request)
        if request is not None:
            cached = next(v.matched_blocks for v in views if v.replica_id == ranked[0]) * self.block_size
            self.ledger.choose(pending_request.metadata.internal_request_id, ranked[0], _work(request, cached), hashes,
                               reason, cancelled=lambda: pending_request.future.cancelled(), ticket=id(pending_request))
        if len(ranked) == 1 or self._first_offer(pending_request):
            return [[by_id[ranked[0]]]]
        return [[by_id[ranked[0]]], [by_id[r] for r in ranked[1:]]]

    def _first_offer(self, pending_request: Optional[PendingRequest]) -> bool:
        """Whether this is the first time replicas are chosen for this routing attempt."""
        if pending_request is None or pending_request.future in self._offered_first_alone:
            return False
        self._offered_first_alone.add(pending_request.future)
        return True

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request = _generate_request(pending_request)
        if request is None:
            return
        chosen, reason = self.ledger.accepted(pending_request.metadata.internal_request_id, replica_id,
                                              _work(request, 0), request.block_hashes, ticket=id(pending_request))
        self.metrics.routing_decision(reason if chosen == replica_id else "fallback")

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.ledger.release(internal_request_id, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._reported.pop(replica_id, None)
        self.ledger.forget_replica(replica_id)

    # -- inputs of the policy ---------------------------------------------------------------------------
    def _load(self, replica: RunningReplica) -> int:
        report = self._report(replica)
        reported = report[0].engine.work_tokens if report else 0
        return max(reported, self.ledger.load(replica.replica_id))

    def _matched(self, replica: RunningReplica, hashes: list[int]) -> int:
        if not hashes:
            return 0
        report = self._report(replica)
        return max(self.ledger.matched_blocks(replica.replica_id, hashes),
                   matched_prefix(hashes, report[1]) if report else 0)

    def _shared(self, replicas: List[RunningReplica], hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` that some replica reports a shared KV tier holds."""
        if not hashes:
            return 0
        shared = 0
        for replica in replicas:
            report = self._report(replica)
            if report is not None and report[0].shared_hashes:
                shared = max(shared, matched_prefix(hashes, report[2]))
        return shared

    def _holds(self, replica: RunningReplica, adapter: str | None) -> bool:
        """Whether the replica's latest report lists LoRA adapter ``adapter`` as resident."""
        report = self._report(replica) if adapter is not None else None
        return report is not None and report[0].engine.lora is not None and adapter in report[0].engine.lora.resident

    def _report(self, replica: RunningReplica) -> tuple[RoutingReport, frozenset[int], frozenset[int]] | None:
        """The replica's latest report, its cached hashes and its shared-tier hashes as sets,
        parsed only when a new report arrives; None before its first one."""
        stats = replica.routing_stats
        if not stats:
            return None
        cached = self._reported.get(replica.replica_id)
        if cached is None or cached[0] is not stats:
            report = RoutingReport.from_dict(stats)
            cached = (stats, report, frozenset(report.block_hashes), frozenset(report.shared_hashes))
            self._reported[replica.replica_id] = cached
        return cached[1], cached[2], cached[3]


def _work(request: GenerateRequest, cached_tokens: int) -> int:
    """What the request can add to a replica's load: the prompt tokens the replica does not hold
    and every token it may generate (as the replicas count their ``work_tokens``)."""
    uncached = max(0, len(request.prompt_token_ids) - cached_tokens)
    return uncached + (request.params.max_tokens or 0) * request.params.n


def _generate_request(pending_request: Optional[PendingRequest]) -> GenerateRequest | None:
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if isinstance(request, GenerateRequest) else None
