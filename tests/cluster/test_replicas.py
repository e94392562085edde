"""cluster/replicas.py on the session's Ray cluster, with stand-in replica actors named as Serve
names them and behaving as Serve's replica actor does while it builds its user class: a replica
still initializing must not hold back the others' reports, must not be asked for stats (Serve
logs a warning for each such call), and is seen as soon as it is ready."""

from __future__ import annotations

import threading
import time

import ray

from raylm.cluster.replicas import REPLICA_PREFIX, SERVE_NAMESPACE, ReplicaStatsPoller, replica_stats

APP = "replicas-test"


@ray.remote(num_cpus=0)
class StandInReplica:
    """Serve's ``ReplicaActor`` as the poller sees it: the actor answers at once, its user class
    (the model load and compiles) is built ``construct_s`` later, and until then
    ``record_routing_stats`` fails (Serve's ``_raise_if_not_initialized``). ``check_s``: how long
    ``was_initialized`` takes to answer (a replica busy starting)."""

    def __init__(self, construct_s: float, running: int, check_s: float = 0.0) -> None:
        self.running = running
        self.check_s = check_s
        self.calls = 0
        self.refused = 0
        self.ready = threading.Event()
        threading.Timer(construct_s, self.ready.set).start()

    def was_initialized(self) -> bool:
        time.sleep(self.check_s)
        return self.ready.is_set()

    def record_routing_stats(self) -> dict[str, int]:
        if not self.ready.is_set():
            self.refused += 1
            raise RuntimeError("the replica is not initialized")
        self.calls += 1
        return {"running": self.running, "calls": self.calls}

    def set_running(self, running: int) -> None:
        self.running = running

    def refused_calls(self) -> int:
        return self.refused


def _start(replica_id: str, construct_s: float, running: int, check_s: float = 0.0) -> ray.actor.ActorHandle:
    return StandInReplica.options(name=f"{REPLICA_PREFIX}{APP}#LLMWorker#{replica_id}",
                                  namespace=SERVE_NAMESPACE).remote(construct_s, running, check_s)


def test_a_starting_replica_neither_delays_the_others_nor_gets_asked_for_stats_before_it_is_ready(serve_cluster):
    ready = _start("ready", 0.0, 2)
    ray.get(ready.set_running.remote(2))
    # Its "not yet" answers come after the poll's first wait, while the ready replica is asked
    # for its first stats: they are not stats.
    starting = _start("starting", 4.0, 7, check_s=0.45)
    ray.get(starting.set_running.remote(7))
    poller = ReplicaStatsPoller(APP, "LLMWorker", wait_s=0.3)
    try:
        started = time.monotonic()
        first = poller.poll()
        assert time.monotonic() - started < 2.0  # the old poll waited 10 s on the starting replica
        assert first == {"ready": {"running": 2, "calls": 1}}
        assert replica_stats(APP, "LLMWorker", timeout_s=5) == {"ready": {"running": 2, "calls": 2}}
        ray.get(ready.set_running.remote(3))
        second = poller.poll()
        assert second == {"ready": {"running": 3, "calls": 3}}  # fresh, while the other still starts
        deadline = time.monotonic() + 30
        while "starting" not in (polled := poller.poll()):
            assert time.monotonic() < deadline
        # Its first stats call came once it was ready, and no call was refused before.
        assert polled["starting"] == {"running": 7, "calls": 1}
        assert ray.get(starting.refused_calls.remote()) == 0
        assert set(replica_stats(APP, "LLMWorker", timeout_s=5)) == {"ready", "starting"}
        ray.kill(starting)
        deadline = time.monotonic() + 30
        while "starting" in (polled := poller.poll()):
            assert time.monotonic() < deadline
        assert set(polled) == {"ready"}
    finally:
        for actor in (ready, starting):
            ray.kill(actor)


def test_a_replica_that_stops_answering_keeps_its_last_report(serve_cluster):
    """A long compile delays a replica's stats answer; admission capacity must not shrink for it."""

    @ray.remote(num_cpus=0)
    class Busy:
        def __init__(self) -> None:
            self.busy_s = 0.0

        def busy_for(self, seconds: float) -> None:
            self.busy_s = seconds

        def was_initialized(self) -> bool:
            return True

        def record_routing_stats(self) -> dict[str, int]:
            time.sleep(self.busy_s)  # the replica's loop is held by a compile
            return {"running": 5}

    busy = Busy.options(name=f"{REPLICA_PREFIX}{APP}#LLMWorker#busy", namespace=SERVE_NAMESPACE).remote()
    try:
        ray.get(busy.busy_for.remote(0.0))  # up and answering
        poller = ReplicaStatsPoller(APP, "LLMWorker", wait_s=0.3)
        assert poller.poll() == {"busy": {"running": 5}}
        ray.get(busy.busy_for.remote(3.0))
        poller.poll()  # this call now takes 3 s to answer
        assert poller.poll() == {"busy": {"running": 5}}  # the last report stands meanwhile
    finally:
        ray.kill(busy)
