"""Replica choice: the longest cached prefix wins unless that replica is too far behind on load;
without one, a replica holding the request's LoRA adapter wins on the same condition. A prefix
that a shared KV tier holds (cache/offload/'s cluster tier) any replica loads instead of
computing it: only what a replica holds beyond that counts in its favour.

Pure and deterministic given ``rng``, so it is tested without Ray; ``PrefixAwareRequestRouter``
feeds it what the replicas report and what this router sent where.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Hashable, Sequence

PREFIX_HIT = "prefix_hit"  # went to the replica holding the longest prefix
LOAD_IMBALANCE = "load_imbalance"  # a replica held the prefix but was too busy: chosen by load
NO_PREFIX = "no_prefix"  # no replica held any of it: chosen by load
PREFIX_SHARED = "prefix_shared"  # every replica can load the prefix from a shared tier: chosen by load
ADAPTER_HIT = "adapter_hit"  # no prefix held, but its LoRA adapter was resident there


@dataclasses.dataclass(frozen=True)
class ReplicaView:
    replica_id: Hashable
    load: int  # tokens waiting + running
    matched_blocks: int  # leading prompt blocks this replica is believed to hold
    holds_adapter: bool = False  # the request's LoRA adapter is resident there (never for base requests)
    shared_blocks: int = 0  # leading prompt blocks a shared KV tier holds, which this replica can load

    @property
    def advantage(self) -> int:
        """Leading blocks this replica holds that it could not load from a shared tier."""
        return max(0, self.matched_blocks - self.shared_blocks)


def matched_prefix(hashes: Sequence[int], held: set[int] | frozenset[int]) -> int:
    """How many leading hashes of the chain ``held`` contains (a chain breaks at the first miss)."""
    count = 0
    for block_hash in hashes:
        if block_hash not in held:
            break
        count += 1
    return count


def choose_replica(views: Sequence[ReplicaView], imbalance_threshold_tokens: int,
                   rng: random.Random) -> tuple[list[Hashable], str]:
    """Replica ids best first, and the reason for the first.

    The longest cached prefix wins unless its holder's load is more than the threshold above
    the least loaded replica; among several holders within it, the least loaded (a hot prefix
    held by two replicas is served by both). Blocks a shared tier holds do not count: every
    replica loads those, so a prefix held only that far is served by load. Failing that, the least loaded replica holding the
    request's LoRA adapter wins on the same condition (Ray Serve LLM's adapter
    affinity: no slot to fill, no adapter evicted elsewhere), so a hot adapter spreads to other
    replicas only once its holders are that much busier.
    """
    if not views:
        return [], NO_PREFIX
    by_load = sorted(views, key=lambda v: v.load)
    best = max(views, key=lambda v: (v.advantage, -v.load))
    if best.advantage > 0 and best.load - by_load[0].load <= imbalance_threshold_tokens:
        rest = [v.replica_id for v in by_load if v.replica_id != best.replica_id]
        return [best.replica_id, *rest], PREFIX_HIT
    holder = next((v for v in by_load if v.holds_adapter), None)
    if holder is not None and holder.load - by_load[0].load <= imbalance_threshold_tokens:
        return [holder.replica_id, *(v.replica_id for v in by_load if v is not holder)], ADAPTER_HIT
    reason = LOAD_IMBALANCE if best.advantage > 0 else PREFIX_SHARED if best.matched_blocks or best.shared_blocks \
        else NO_PREFIX
    if len(views) <= 2:
        return [v.replica_id for v in by_load], reason
    first, second = rng.sample(list(views), 2)  # power of two choices
    pick = first if first.load <= second.load else second
    return [pick.replica_id, *(v.replica_id for v in by_load if v.replica_id != pick.replica_id)], reason
