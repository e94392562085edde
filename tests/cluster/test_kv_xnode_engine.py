"""Engines on two nodes sharing prefixes through the KV cluster tier: ``tests/kv_xnode_engine_scenario.py``
starts a two-node Ray cluster of its own, isolated from the session's, in a subprocess; it prints one
JSON line of findings."""

from __future__ import annotations

from tests.scenario_process import run_scenario

BLOCK_SIZE = 16
BLOCK_BYTES = 3 * 2 * BLOCK_SIZE * 2 * 16 * 4  # layers x (K, V) x tokens x KV heads x head dim x float32


def _loadable_tokens(lengths: list[int]) -> int:
    """Prompt tokens in full blocks before each prompt's last token: what a load can bring."""
    return sum((n - 1) // BLOCK_SIZE * BLOCK_SIZE for n in lengths)


def _cluster_tier(counters: dict) -> dict:
    (tier,) = counters["tiers"]  # host tier off: the cluster tier alone
    assert tier["tier"] == "cluster"
    return tier


def test_a_replica_on_another_node_loads_the_prefixes_one_node_computed():
    """Replica A (node A, with the directory) computes and publishes; replica B (node B) loads the
    prefixes through Ray's object transfer, also after A was killed; its tokens equal A's and an
    engine's with offload off."""
    result = run_scenario("tests.kv_xnode_engine_scenario", timeout=300)
    assert result["leftover_pids"] == []

    nodes = result["nodes"]
    assert nodes["directory"] == nodes["a"] == nodes["head"] != nodes["b"]  # B's loads cross raylets

    first_lengths, second_lengths = result["prompt_lengths"]
    reference = result["reference"]
    first_reference, second_reference = reference[:len(first_lengths)], reference[len(first_lengths):]
    assert result["a_tokens"] == first_reference and result["b_tokens"] == first_reference
    assert result["a_second_tokens"] == second_reference
    assert result["a_killed"] and result["b_second_tokens"] == second_reference

    # Every prompt's full blocks came to B from the cluster tier (or from B's pool, where a prompt
    # of the same batch had loaded them already), with or without the replica that published them.
    b1, b2 = result["b_after_first"], result["b_after_second"]
    assert b1["loaded_tokens"] + b1["prefix_hits"] == _loadable_tokens(first_lengths) > 0
    assert (b2["loaded_tokens"] - b1["loaded_tokens"] + b2["prefix_hits"] - b1["prefix_hits"]
            == _loadable_tokens(second_lengths) > 0)
    tier = _cluster_tier(b2)
    assert tier["hits"] * BLOCK_SIZE == b2["loaded_tokens"] and tier["misses"] == 0 and tier["errors"] == {}
    assert tier["load_bytes"] == tier["hits"] * BLOCK_BYTES
    assert b2["used_blocks"] == 0

    # What B loaded, A put: B published nothing new (its blocks were there already), and the
    # directory holds exactly the blocks A stored.
    assert tier["stored"] == 0
    assert _cluster_tier(result["a_after_second"])["stored"] == result["directory_blocks"] > 0
