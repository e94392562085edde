"""The leader process of the tests' mesh over two processes (tests/workers/test_multihost.py).

It runs in a fresh interpreter (``multiprocessing`` spawn): ``jax.distributed`` must start
before JAX's backend, which the test process has long started. It starts its follower (a
child with a pipe), joins the group, serves the prompts greedily and sends back the tokens.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from typing import Any

# One CPU device per process (the suite forces two in the test process), and the suite's
# compile setting (tests/conftest.py), in both processes: they must compile the same programs.
CHILD_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


def lead(results: Connection, model: str, engine_args: dict[str, Any], coordinator_address: str,
         prompts: list[list[int]], max_tokens: int) -> None:
    """Serve ``prompts`` (greedy, ``max_tokens`` each) over the group; send back ``{"tokens": [...],
    "refusal": "...", "relay_s": [...]}`` (the message a logits processor request got, and each
    step's relay time)."""
    os.environ.update(CHILD_ENV)
    from raylm.workers.engine.multihost_pipe import start_pipe_followers

    relay, followers = start_pipe_followers(model, engine_args, coordinator_address, env=CHILD_ENV)
    from raylm.workers.engine.distributed_init import init_distributed, leave_distributed

    init_distributed(coordinator_address, engine_args["num_hosts"], 0)
    from raylm.workers.core.sampling_params import SamplingParams
    from raylm.workers.engine.engine_args import EngineArgs
    from raylm.workers.engine.multihost_engine import MultiHostEngine
    from raylm.workers.engine.replica_model import load_replica_model

    args = EngineArgs.from_kwargs(**engine_args)
    engine = MultiHostEngine(load_replica_model(model, args), args, relay, progress=lambda shapes: shapes)
    timed = engine.runner.relay = TimedRelay(relay)
    try:
        engine.add_request("processed", prompts[0], SamplingParams(logits_processors=[lambda ids, logits: logits]))
        refusal = ""
    except ValueError as error:
        refusal = str(error)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        tokens.update((out.request_id, list(out.outputs[0].token_ids)) for out in engine.step() if out.finished)
    engine.close()
    leave_distributed()
    for follower in followers:
        follower.join(30)
    results.send({"tokens": [tokens[str(i)] for i in range(len(prompts))], "refusal": refusal, "relay_s": timed.seconds})


class TimedRelay:
    """A relay that times its sends (what relaying costs the leader per step)."""

    def __init__(self, relay):
        self.relay, self.seconds = relay, []

    def send(self, message) -> None:
        started = time.perf_counter()
        self.relay.send(message)
        self.seconds.append(time.perf_counter() - started)


class RayLeader:
    """The leader as a Ray actor (``ray.remote(RayLeader)``): a fresh process, like a replica's,
    whose follower is a ``MeshFollower`` actor (workers/serve/multihost_actors.py)."""

    def __init__(self, model: str, engine_args: dict[str, Any]):
        from raylm.workers.serve.multihost_actors import start_mesh_engine

        self.engine = start_mesh_engine(model, engine_args)

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        from raylm.workers.core.sampling_params import SamplingParams

        timed = self.engine.runner.relay = TimedRelay(self.engine.runner.relay)
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            self.engine.add_request(str(i), prompt, greedy)
        tokens: dict[str, list[int]] = {}
        started = time.perf_counter()
        while self.engine.has_unfinished_requests():
            tokens.update((out.request_id, list(out.outputs[0].token_ids)) for out in self.engine.step() if out.finished)
        return {"tokens": [tokens[str(i)] for i in range(len(prompts))], "relay_s": timed.seconds,
                "step_s": (time.perf_counter() - started) / len(timed.seconds)}
