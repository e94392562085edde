"""Joining the ``jax.distributed`` group of a mesh over several hosts.

Its own module because it must run before anything starts JAX's backend, which importing the
engine does (``EngineArgs`` reads the backend): a host's process imports this, joins, and only
then imports the engine.
"""

from __future__ import annotations

import jax


def init_distributed(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Join the group (process 0, the leader, serves ``coordinator_address``, host:port). On CPU
    the collectives between processes go over gloo."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id)


def leave_distributed() -> None:
    """Leave the group: every process calls it (a barrier), after the leader's engine closed
    and its followers left their loops."""
    jax.distributed.shutdown()
