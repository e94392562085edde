"""A Ray Serve ``RequestRouter`` for the worker deployment that prefers the replica already
holding the prompt's prefix in its KV cache.

What a replica holds comes from two sources: its routing stats (the hashes of its cached
blocks, refreshed every ``request_routing_stats_period_s``) and this router's ledger of which
prompts it sent where (immediate, so a burst sharing a prefix sticks to one replica before
the next stats report). Load is the larger of the replica's reported queued + running tokens
and the tokens this router has in flight there, charged the moment the replica is chosen.

Serve hands each chosen replica to the oldest waiting request (``FIFOMixin``), which is not
always the one it was chosen for when several wait at once. Matching by request id instead
would hang: the calls one HTTP request fans out to (several prompts, ``n``) share Serve's
internal request id. The ledger follows what was actually accepted, so loads stay right.
"""

from __future__ import annotations

import random
from typing import Any, List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from router.prefix_policy import ReplicaView, choose_replica, matched_prefix
from router.routing_ledger import RoutingLedger
from workers.replica_protocol import GenerateRequest


class PrefixAwareRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, imbalance_threshold_tokens: int = 2048, max_tracked_blocks: int = 200_000,
                         model: str = "", seed: int | None = None) -> None:
        self.imbalance_threshold_tokens = imbalance_threshold_tokens
        self.rng = random.Random(seed)
        self.ledger = RoutingLedger(max_tracked_blocks)
        self._reported: dict[ReplicaID, tuple[list[int], frozenset[int]]] = {}
        from cluster.metrics import RouterMetrics

        self.metrics = RouterMetrics(model)

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = _generate_request(pending_request)
        hashes = request.block_hashes if request is not None else []
        by_id = {r.replica_id: r for r in candidate_replicas}
        views = [ReplicaView(r.replica_id, self._load(r), self._matched(r, hashes)) for r in candidate_replicas]
        ranked, reason = choose_replica(views, self.imbalance_threshold_tokens, self.rng)
        if request is not None:
            self.ledger.choose(pending_request.metadata.internal_request_id, ranked[0], _tokens(request), hashes, reason,
                               cancelled=lambda: pending_request.future.cancelled())
        return [[by_id[ranked[0]]], [by_id[r] for r in ranked[1:]]] if len(ranked) > 1 else [[by_id[ranked[0]]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request = _generate_request(pending_request)
        if request is None:
            return
        chosen, reason = self.ledger.accepted(pending_request.metadata.internal_request_id, replica_id,
                                              _tokens(request), request.block_hashes)
        self.metrics.routing_decision(reason if chosen == replica_id else "fallback")

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.ledger.release(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._reported.pop(replica_id, None)
        self.ledger.forget_replica(replica_id)

    # -- inputs of the policy ---------------------------------------------------------------------------
    def _load(self, replica: RunningReplica) -> int:
        stats = replica.routing_stats or {}
        reported = int(stats.get("waiting_tokens", 0)) + int(stats.get("running_tokens", 0))
        return max(reported, self.ledger.load(replica.replica_id))

    def _matched(self, replica: RunningReplica, hashes: list[int]) -> int:
        if not hashes:
            return 0
        return max(self.ledger.matched_blocks(replica.replica_id, hashes),
                   matched_prefix(hashes, self._reported_hashes(replica)))

    def _reported_hashes(self, replica: RunningReplica) -> frozenset[int]:
        """The replica's reported hashes as a set, rebuilt only when a new report arrives."""
        stats = replica.routing_stats or {}
        report = stats.get("block_hashes") or []
        cached = self._reported.get(replica.replica_id)
        if cached is None or cached[0] is not report:
            cached = (report, frozenset(report))
            self._reported[replica.replica_id] = cached
        return cached[1]


def _tokens(request: GenerateRequest) -> int:
    """What the request can add to a replica's load: its prompt and all the tokens it may generate."""
    return len(request.prompt_token_ids) + (request.params.max_tokens or 0) * request.params.n


def _generate_request(pending_request: Optional[PendingRequest]) -> GenerateRequest | None:
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if isinstance(request, GenerateRequest) else None
