"""A replica whose mesh spans hosts, on Ray: the replica's own process leads, one follower actor
per other host follows (workers/engine/multihost_engine.py).

The leader's plans go to the followers as Ray actor calls, fired in order and not waited for:
an actor runs one caller's calls in submission order, and the programs' collectives make the
leader wait for its followers anyway. (A step's message is the plan, a few kB; submitting the
call takes the leader tens of microseconds, against a step's milliseconds.) Before each send
the leader collects the calls that finished, so a follower's error ends the leader's next step
with that error rather than a hang.

A replica over several hosts gets a placement group with one bundle per host
(deploy/app_builder.py): the replica's actor takes bundle 0 and follower ``i`` bundle ``i``.
Nothing here starts JAX at import: every process joins ``jax.distributed`` first.
"""

from __future__ import annotations

import socket
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raylm.workers.runner.multihost import Message


@ray.remote
class MeshFollower:
    """One follower host of a replica's mesh: joins the group, builds its engine on the leader's
    first message, then launches what the leader relays."""

    def __init__(self, model: str, engine_args: dict[str, Any], coordinator_address: str, process_id: int):
        from raylm.workers.engine.distributed_init import init_distributed

        init_distributed(coordinator_address, engine_args["num_hosts"], process_id)
        from raylm.workers.engine.engine_args import EngineArgs
        from raylm.workers.engine.multihost_engine import FollowerHost
        from raylm.workers.engine.replica_model import load_replica_model

        args = EngineArgs.from_kwargs(**engine_args)
        self.host = FollowerHost(load_replica_model(model, args), args)

    def handle(self, message: Message) -> bool:
        return self.host.handle(message)


class RayRelay:
    """The leader's end: each message is one actor call per follower."""

    def __init__(self, followers: list[ray.actor.ActorHandle]):
        self.followers = followers
        self.in_flight: list[ray.ObjectRef] = []

    def send(self, message: Message) -> None:
        done, self.in_flight = ray.wait(self.in_flight, num_returns=len(self.in_flight), timeout=0)
        ray.get(done)  # a follower's error, raised here
        self.in_flight += [follower.handle.remote(message) for follower in self.followers]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def start_followers(model: str, engine_args: dict[str, Any]) -> tuple[RayRelay, str]:
    """Start the followers of this process's mesh (one per other host, each with this actor's
    resources and environment, in its bundle of this actor's placement group, if it has one);
    returns the relay to them and the coordinator address this process (process 0) serves."""
    coordinator_address = f"{ray.util.get_node_ip_address()}:{_free_port()}"
    group = ray.util.get_current_placement_group()
    followers = []
    for process_id in range(1, engine_args["num_hosts"]):
        if group is None:  # as this actor asked
            resources = ray.get_runtime_context().get_assigned_resources()
            options = {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0)}
        else:  # its host's bundle
            bundle = group.bundle_specs[process_id]
            options = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0),
                       "scheduling_strategy": PlacementGroupSchedulingStrategy(group, process_id)}
        # (its runtime environment, XLA_FLAGS' device count included, is this actor's: Ray's default)
        followers.append(MeshFollower.options(**options).remote(model, engine_args, coordinator_address, process_id))
    return RayRelay(followers), coordinator_address


def start_mesh_engine(model: str, engine_args: dict[str, Any], background_warmup: bool = False):
    """This process leads a mesh over ``engine_args["num_hosts"]`` hosts: starts the followers,
    joins the group and returns its ``MultiHostEngine`` (JAX must not have started here)."""
    relay, coordinator_address = start_followers(model, engine_args)
    from raylm.workers.engine.distributed_init import init_distributed

    init_distributed(coordinator_address, engine_args["num_hosts"], 0)
    from raylm.workers.engine.engine_args import EngineArgs
    from raylm.workers.engine.multihost_engine import MultiHostEngine
    from raylm.workers.engine.replica_model import load_replica_model

    args = EngineArgs.from_kwargs(**engine_args)
    return MultiHostEngine(load_replica_model(model, args), args, relay, background_warmup=background_warmup)
