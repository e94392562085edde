"""Read every worker replica's stats directly, replica by replica.

A deployment handle routes each call to *some* replica; operators (``raylm status``) and tests
need all of them. Serve names replica actors ``SERVE_REPLICA::<app>#<deployment>#<id>`` and
each answers ``record_routing_stats`` (the controller calls it for request routers).
"""

from __future__ import annotations

from typing import Any

import ray

from cluster.names import DEFAULT_APP_NAME, WORKER_DEPLOYMENT

REPLICA_PREFIX = "SERVE_REPLICA::"
SERVE_NAMESPACE = "serve"


def replica_actor_names(app_name: str, deployment: str) -> list[str]:
    prefix = f"{REPLICA_PREFIX}{app_name}#{deployment}#"
    return sorted(
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == SERVE_NAMESPACE and a["name"].startswith(prefix)
    )


def running_replicas(app_name: str = DEFAULT_APP_NAME, deployment: str = WORKER_DEPLOYMENT) -> int:
    """How many of the deployment's replicas Serve reports RUNNING."""
    from ray import serve

    return serve.status().applications[app_name].deployments[deployment].replica_states.get("RUNNING", 0)


def replica_stats(app_name: str = DEFAULT_APP_NAME, deployment: str = WORKER_DEPLOYMENT, timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
    """``{replica id: routing stats}`` for each live replica (replicas that fail to answer are left out)."""
    return _ask_replicas(replica_actor_names(app_name, deployment), timeout_s)


def poll_replica_stats(app_name: str, deployment: str, previous: dict[str, dict[str, Any]],
                       timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
    """Like ``replica_stats``, but a replica that still exists and did not answer in time (busy
    compiling, say) keeps its ``previous`` report instead of dropping out; one that never
    reported (still loading) stays out until it does."""
    names = replica_actor_names(app_name, deployment)
    fresh = _ask_replicas(names, timeout_s)
    listed = [name.rsplit("#", 1)[1] for name in names]
    return {rid: fresh[rid] if rid in fresh else previous[rid] for rid in listed if rid in fresh or rid in previous}


def _ask_replicas(names: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    refs = {}
    for name in names:
        try:
            refs[name.rsplit("#", 1)[1]] = ray.get_actor(name, namespace=SERVE_NAMESPACE).record_routing_stats.remote()
        except ValueError:  # the replica went away between listing and lookup
            continue
    out = {}
    for replica_id, ref in refs.items():
        try:
            out[replica_id] = ray.get(ref, timeout=timeout_s)
        except (ray.exceptions.RayError, TimeoutError):
            continue
    return out
