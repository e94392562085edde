"""A served replica's two pipeline stages on two nodes: ``tests/pipeline_multinode_scenario.py``
starts a two-node Ray cluster of its own (one CPU a node), isolated from the session's, in a
subprocess; it prints one JSON line of findings."""

from __future__ import annotations

from tests.scenario_process import run_scenario

END_WITHIN_S = 30.0


def test_stages_on_two_nodes_serve_the_unsplit_greedy_text_and_a_dead_stage_replaces_the_group():
    result = run_scenario("tests.pipeline_multinode_scenario", timeout=400)
    print(f"\n{ {k: v for k, v in result.items() if k.endswith('_s') or k == 'seconds'} }")
    assert result["leftover_pids"] == []

    # Stage 0 holds layers 0-14, the replica (stage 1) 15-29; each on its own node of the two.
    nodes = result["cluster_nodes"]
    for stages in (result["stages"], result["stages_after"]):
        assert [(s["stage"], s["layers"]) for s in stages] == [(0, [0, 15]), (1, [15, 30])]
        assert sorted(s["node_id"] for s in stages) == nodes and len(set(nodes)) == 2
        assert stages[0]["pid"] != stages[1]["pid"]

    # Over HTTP, split over two nodes, the greedy text of the unsplit model in one process.
    reference = result["reference"]
    assert all(text.strip() for text in reference)
    assert result["served"] == reference

    # Killing the stage on the other node ends every stream in flight with an error, promptly;
    # Serve replaces the replica with both its stages, which answers the same text again.
    assert result["killed_stage"] == 0
    assert all(kind == "error-event" or kind.startswith("status 5") for kind in result["endings"]), result["endings"]
    assert result["last_ending_s"] < END_WITHIN_S
    assert {s["pid"] for s in result["stages_after"]}.isdisjoint({s["pid"] for s in result["stages"]})
    assert result["served_after"] == reference
