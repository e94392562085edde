"""router/prefix_policy.py: matched prefixes are chains; replica choice prefers the longest
prefix until the load gap is too big, then a replica holding the LoRA adapter, else the less
loaded of two random replicas."""

from __future__ import annotations

import random

from raylm.router.prefix_policy import (
    ADAPTER_HIT,
    LOAD_IMBALANCE,
    NO_PREFIX,
    PREFIX_HIT,
    PREFIX_SHARED,
    ReplicaView,
    choose_replica,
    matched_prefix,
)


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


def test_a_prefix_a_shared_tier_holds_counts_only_beyond_what_any_replica_can_load():
    rng = random.Random(0)
    # "b" holds 8 blocks, the cluster tier 8 too: any replica loads them, so the idle one serves it.
    held = [ReplicaView("a", 100, 0, shared_blocks=8), ReplicaView("b", 400, 8, shared_blocks=8)]
    assert choose_replica(held, 1000, rng) == (["a", "b"], PREFIX_SHARED)
    # What "b" holds beyond the tier's 5 blocks still draws the request to it, within the load gap.
    beyond = [ReplicaView("a", 100, 0, shared_blocks=5), ReplicaView("b", 400, 8, shared_blocks=5)]
    assert choose_replica(beyond, 1000, rng) == (["b", "a"], PREFIX_HIT)
    assert choose_replica(beyond, 200, rng) == (["a", "b"], LOAD_IMBALANCE)
    # Nothing held anywhere but in the tier: by load, and said so.
    tier_only = [ReplicaView("a", 30, 0, shared_blocks=3), ReplicaView("b", 10, 0, shared_blocks=3)]
    assert choose_replica(tier_only, 1000, rng) == (["b", "a"], PREFIX_SHARED)


def test_lora_adapter_holders_win_after_the_prefix_until_too_busy():
    rng = random.Random(0)
    views = [ReplicaView("a", 100, 0), ReplicaView("b", 400, 0, True), ReplicaView("c", 300, 0, True)]
    assert choose_replica(views, 500, rng) == (["c", "a", "b"], ADAPTER_HIT)
    assert choose_replica(views, 150, rng)[1] == NO_PREFIX  # its holders are too busy: it spreads
    assert choose_replica([ReplicaView("a", 100, 3), ReplicaView("b", 0, 0, True)], 500, rng) == (["a", "b"], PREFIX_HIT)
    assert choose_replica([ReplicaView("a", 900, 3), ReplicaView("b", 0, 0, True)], 500, rng) == (["b", "a"], ADAPTER_HIT)


def test_power_of_two_choices_never_picks_the_busiest_of_three():
    rng = random.Random(1)
    views = [ReplicaView("a", 0, 0), ReplicaView("b", 50, 0), ReplicaView("c", 999, 0)]
    picks = {choose_replica(views, 100, rng)[0][0] for _ in range(200)}
    assert picks == {"a", "b"}
