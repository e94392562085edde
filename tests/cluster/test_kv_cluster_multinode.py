"""The KV cluster tier across nodes: ``tests/kv_cluster_scenario.py`` starts a two-node Ray cluster of
its own, isolated from the session's, in a subprocess; it prints one JSON line of findings."""

from __future__ import annotations

from tests.scenario_process import run_scenario


def test_blocks_published_on_one_node_are_fetched_on_another():
    """Published by an actor on node A, fetched by tiers on node B (a transfer) and on node A."""
    result = run_scenario("tests.kv_cluster_scenario", timeout=240)

    nodes = result["nodes"]
    assert nodes["publisher"] == nodes["reader_a"] != nodes["reader_b"]
    assert result["stored"] == 16
    for where in ("cross_node", "same_node"):
        fetched = result[where]
        assert fetched["contains"] == 16 and fetched["errors"] == {}, where
        assert fetched["equal"] == [True] * 16, where
    assert result["same_node"]["read_only"] == [True] * 16  # views of the node's shared memory
    assert result["leftover_pids"] == []
