"""cluster/replicas.py without Ray: polling keeps the last report of a replica too busy to answer."""

from __future__ import annotations


def test_a_replica_too_busy_to_answer_keeps_its_capacity(monkeypatch):
    """A long compile delays a replica's stats answer; admission capacity must not shrink for it."""
    from cluster import replicas

    names = ["SERVE_REPLICA::app#LLMWorker#a", "SERVE_REPLICA::app#LLMWorker#b", "SERVE_REPLICA::app#LLMWorker#new"]
    monkeypatch.setattr(replicas, "replica_actor_names", lambda app, deployment: names)
    monkeypatch.setattr(replicas, "_ask_replicas", lambda listed, timeout_s: {"a": {"running": 2}})
    previous = {"a": {"running": 1}, "b": {"running": 5}, "gone": {"running": 0}}
    polled = replicas.poll_replica_stats("app", "LLMWorker", previous)
    # a answered; b is busy and keeps its report; new never reported; gone is no longer listed
    assert polled == {"a": {"running": 2}, "b": {"running": 5}}
