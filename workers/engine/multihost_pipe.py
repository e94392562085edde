"""A mesh over several processes of one machine, without Ray: the followers are child processes
and the leader's plans reach them through ``multiprocessing`` pipes (the offline path; under
Ray the followers are actors, workers/serve/multihost_actors.py). The followers run the same
loop either way (``run_follower``)."""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import Connection
from typing import Any

from raylm.workers.runner.multihost import Message


class PipeRelay:
    """The leader's end: one pipe per follower, written in order."""

    def __init__(self, connections: list[Connection]):
        self.connections = connections

    def send(self, message: Message) -> None:
        for connection in self.connections:
            connection.send(message)


def follower_process(connection: Connection, model: str, engine_args: dict[str, Any], coordinator_address: str,
                     num_hosts: int, process_id: int, env: dict[str, str]) -> None:
    """A follower child process: join the group, load the model, follow the leader's pipe."""
    os.environ.update(env)  # before JAX starts its backend (e.g. XLA_FLAGS' device count)
    from raylm.workers.engine.distributed_init import init_distributed, leave_distributed

    init_distributed(coordinator_address, num_hosts, process_id)
    from raylm.workers.engine.engine_args import EngineArgs
    from raylm.workers.engine.multihost_engine import run_follower
    from raylm.workers.engine.replica_model import load_replica_model

    args = EngineArgs.from_kwargs(**engine_args)
    run_follower(load_replica_model(model, args), args, connection.recv)
    leave_distributed()


def start_pipe_followers(model: str, engine_args: dict[str, Any], coordinator_address: str,
                         env: dict[str, str] | None = None) -> tuple[PipeRelay, list[multiprocessing.Process]]:
    """Start processes 1 .. num_hosts - 1 of the group (fresh interpreters: JAX must not have
    started in them) and return the leader's relay to them; the caller is process 0, joins the
    group (``init_distributed``), builds its ``MultiHostEngine`` with the relay, and once that
    is closed, leaves the group and joins the processes (tests/multihost_leader.py does)."""
    context = multiprocessing.get_context("spawn")
    num_hosts = engine_args.get("num_hosts", 1)
    ends, processes = [], []
    for process_id in range(1, num_hosts):
        leader_end, follower_end = context.Pipe()
        process = context.Process(
            target=follower_process, daemon=True,
            args=(follower_end, model, engine_args, coordinator_address, num_hosts, process_id, env or {}))
        process.start()
        ends.append(leader_end)
        processes.append(process)
    return PipeRelay(ends), processes
