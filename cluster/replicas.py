"""Read every worker replica's stats directly, replica by replica.

A deployment handle routes each call to *some* replica; operators (``raylm status``) and tests
need all of them. Serve names replica actors ``SERVE_REPLICA::<app>#<deployment>#<id>`` and
each answers ``record_routing_stats`` (the controller calls it for request routers).

Serve builds a replica's user class after its actor starts (the model load and first compiles:
seconds), and until then ``record_routing_stats`` fails and Serve logs "Replica record routing
stats failed." for every call. So a replica is first asked Serve's ``was_initialized`` and only
asked for stats once it says yes: a starting replica costs no warnings in the logs.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from raylm.cluster.names import DEFAULT_APP_NAME, WORKER_DEPLOYMENT

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


class ReplicaStatsPoller:
    """Follows every replica's stats for a router, one poll at a time.

    A replica still in its constructor (loading, compiling) is asked whether it is initialized
    until it is, then for its stats. Waiting a full timeout on a slow replica at every poll
    delayed every other replica's report and, after a replacement, the moment the new replica
    was admitted work (~9 s of a 27 s replacement). So each replica has at most one call in
    flight: a poll waits ``wait_s`` for the calls outstanding, takes the answers that came, and
    leaves the rest in flight for the next poll. A replica that just said it is initialized is
    asked for its stats in the same poll (one more wait), so it is seen as soon as it can
    answer. A replica that is listed but did not answer keeps its previous report (a long
    compile must not shrink capacity); one that never reported stays out until it does.
    """

    def __init__(self, app_name: str, deployment: str, wait_s: float = 1.0) -> None:
        self.app_name = app_name
        self.deployment = deployment
        self.wait_s = wait_s
        self.stats: dict[str, dict[str, Any]] = {}
        self._in_flight: dict[str, ray.ObjectRef] = {}  # a stats call, or an initialization check
        self._initialized: set[str] = set()

    def poll(self) -> dict[str, dict[str, Any]]:
        """``{replica id: routing stats}``: fresh answers where they came, else the last report."""
        listed = {_replica_id(name): name for name in replica_actor_names(self.app_name, self.deployment)}
        for replica_id in set(self._in_flight) - set(listed):
            del self._in_flight[replica_id]
        self._initialized &= set(listed)
        for replica_id, name in listed.items():
            if replica_id not in self._in_flight:
                ref = _stats_call(name) if replica_id in self._initialized else _initialized_call(name)
                if ref is not None:
                    self._in_flight[replica_id] = ref
        answers, died = self._collect_in_flight()
        fresh, just_initialized = self._sort_answers(answers)
        if just_initialized:  # ask them for stats now rather than a poll later
            for replica_id in just_initialized:
                if (ref := _stats_call(listed[replica_id])) is not None:
                    self._in_flight[replica_id] = ref
            more, more_died = self._collect_in_flight()
            fresh, died = {**fresh, **self._sort_answers(more)[0]}, died | more_died
        self._initialized -= died
        # A replica that died reports again once replaced; one still busy keeps its last report.
        stats = {rid: report for rid, report in self.stats.items() if rid in listed and rid not in died}
        self.stats = {**stats, **fresh}
        return dict(self.stats)

    def _sort_answers(self, answers: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], set[str]]:
        """The stats among ``answers`` (from initialized replicas), and the replicas whose
        initialization check just said yes (marked initialized: asked for stats from now on)."""
        fresh = {rid: answer for rid, answer in answers.items() if rid in self._initialized}
        just_initialized = {rid for rid, answer in answers.items() if rid not in self._initialized and answer is True}
        self._initialized |= just_initialized
        return fresh, just_initialized

    def _collect_in_flight(self) -> tuple[dict[str, Any], set[str]]:
        """The in-flight calls that answer within ``wait_s`` (taken out of flight), and the
        replicas whose call failed."""
        answers, died = _collect(self._in_flight, self.wait_s)
        for replica_id in [*answers, *died]:
            del self._in_flight[replica_id]
        return answers, died


def _stats_call(name: str) -> ray.ObjectRef | None:
    try:
        return ray.get_actor(name, namespace=SERVE_NAMESPACE).record_routing_stats.remote()
    except ValueError:  # the replica went away between listing and lookup
        return None


def _initialized_call(name: str) -> ray.ObjectRef | None:
    """Serve's ``was_initialized`` on the replica actor: True once its user class is built."""
    try:
        return ray.get_actor(name, namespace=SERVE_NAMESPACE).was_initialized.remote()
    except ValueError:
        return None


def _replica_id(actor_name: str) -> str:
    return actor_name.rsplit("#", 1)[1]


def _collect(refs: dict[str, ray.ObjectRef], timeout_s: float) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """Wait up to ``timeout_s`` for all of ``refs`` (one deadline for all); return the answers
    that came, by replica id, and the ids whose call failed (the replica died)."""
    ready = set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)[0]) if refs else set()
    answers, failed = {}, set()
    for replica_id, ref in refs.items():
        if ref in ready:
            try:
                answers[replica_id] = ray.get(ref)
            except ray.exceptions.RayError:
                failed.add(replica_id)
    return answers, failed


def _ask_replicas(names: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    """One answer per initialized replica that gives one within ``timeout_s`` (the checks included)."""
    deadline = time.monotonic() + timeout_s
    checks = {name: ref for name in names if (ref := _initialized_call(name)) is not None}
    initialized = _collect(checks, timeout_s)[0]
    ready = [name for name, answer in initialized.items() if answer is True]
    calls = {_replica_id(name): ref for name in ready if (ref := _stats_call(name)) is not None}
    return _collect(calls, max(0.0, deadline - time.monotonic()))[0]
