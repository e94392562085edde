"""router/routing_ledger.py: what this router sent where. Charges on choice, moved on acceptance
elsewhere, released on completion or expiry; sent blocks count for a grace period; bounded."""

from __future__ import annotations

import random

from raylm.router.prefix_policy import ReplicaView, choose_replica
from raylm.router.routing_ledger import RoutingLedger


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
