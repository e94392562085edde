"""Multi-node serving on one machine: replicas on two nodes, and the cluster autoscaler adding one.

The scenario (``tests/multinode_scenario.py``) needs its own Ray cluster with an autoscaler, so it
runs in a subprocess, isolated from the session's cluster; it prints one JSON line of findings.
"""

from __future__ import annotations

from tests.scenario_process import run_scenario


def test_replicas_spread_over_nodes_and_autoscaler_adds_a_node():
    result = run_scenario("tests.multinode_scenario", timeout=540)

    # One worker node to start with (min_workers); the second replica could not be placed, so the
    # autoscaler launched a second node for it.
    assert len(result["worker_nodes_before"]) == 1
    assert len(result["worker_nodes_after"]) == 2
    assert len(result["autoscaler_launches"]) == 2
    assert result["replica_states"] == {"RUNNING": 2}

    # The two replicas sit on the two different worker nodes, and both served requests.
    replica_nodes = result["replica_nodes"]
    assert sorted(replica_nodes.values()) == result["worker_nodes_after"]
    assert result["statuses"] == [200] * len(result["statuses"]), result["errors"]
    assert all(tokens == 16 for tokens in result["completion_tokens"])
    assert all(count > 0 for count in result["replica_requests"].values()), result["replica_requests"]
    assert sum(result["replica_requests"].values()) == len(result["statuses"])

    # The cluster is gone: no process of it outlives the scenario.
    assert result["leftover_pids"] == []
