"""Pipeline stages as Ray actors, placed by a placement group.

Inside a Serve replica started with ``placement_group_bundles`` (deploy/app_builder.py: one
bundle for the replica, which is the last stage, and one per other stage) stage ``i`` takes bundle
``i + 1`` of the replica's group, so Serve starts, places and removes the replica and its stages
as one unit. Outside Serve (the offline ``LLM``) the engine makes a group of its own. A stage's
actor reads its own layers from the checkpoint (the path must exist on its node, as for every
replica) and lives as long as the replica: its owner (the replica's actor) going away ends it.

Each step passes stage ``i``'s output to stage ``i + 1`` as an object reference (node to node,
not through the engine). A dead stage fails the step at once (``RayActorError``): the engine fails
the step's requests with a clear error and the replica's health check reports the dead stage,
so Serve replaces the whole group.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import jax
import numpy as np
import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raylm.cluster.local_ray import apply_local_ray_env
from raylm.model.config.model_config import ModelConfig
from raylm.model.quantization.quant_array import weight_bytes
from raylm.workers.core.step_plan import SchedulerOutput
from raylm.workers.pipeline.pipeline_runner import LocalStage
from raylm.workers.pipeline.stage_runners import StageSpan
from raylm.workers.pipeline.stage_spec import StageSpec, build_stage

logger = logging.getLogger(__name__)

STAGE_RESULT_TIMEOUT_S = 600.0  # a step's first use of an uncompiled program variant compiles inside it
STAGE_START_TIMEOUT_S = 900.0  # reading a large stage's weights and compiling every bucket


class PipelineStageActor(LocalStage):
    """One stage's runner in its own process (``ray.remote``'d by ``start_ray_stages``)."""

    def __init__(self, spec: StageSpec):
        super().__init__(build_stage(spec), spec.span)

    @ray.method(concurrency_group="health")
    def ping(self) -> bool:
        """Answers while a step runs (its own thread): the replica's health check asks it."""
        return True

    def describe(self) -> dict[str, Any]:
        """Where the stage runs and what it holds (``raylm status``, tests)."""
        return {**super().describe(), "node_id": ray.get_runtime_context().get_node_id(),
                "host": socket.gethostname(), "weight_bytes": weight_bytes(self.runner.params),
                "kv_bytes": _pool_bytes(self.runner.kv)}


class RayStage:
    """The engine's handle on a stage actor (``workers.pipeline.pipeline_runner.StageHandle``)."""

    def __init__(self, actor: Any, span: StageSpan, own_group: PlacementGroup | None = None):
        self.actor, self.span = actor, span
        self.own_group = own_group  # a group made for these stages (not Serve's): removed with them

    def run(self, plan: SchedulerOutput, hidden: Any, packed_unavailable: frozenset[int]) -> ray.ObjectRef:
        return self.actor.run.remote(plan, hidden, packed_unavailable)

    def resolve(self, output: ray.ObjectRef) -> list[np.ndarray]:
        return ray.get(output, timeout=STAGE_RESULT_TIMEOUT_S)

    def warmup(self, num_scheduler_steps: int, shapes: list[tuple[str, tuple[int, ...]]],
               lora_slots: bool) -> ray.ObjectRef:
        return self.actor.warmup.remote(num_scheduler_steps, shapes, lora_slots)

    def wait(self, pending: ray.ObjectRef) -> None:
        ray.get(pending, timeout=STAGE_START_TIMEOUT_S)

    def take_expert_load(self) -> np.ndarray | None:
        return ray.get(self.actor.take_expert_load.remote(), timeout=STAGE_RESULT_TIMEOUT_S)

    def matrix_params(self, config: ModelConfig) -> int:
        return ray.get(self.actor.matrix_params.remote(config), timeout=STAGE_RESULT_TIMEOUT_S)

    def busy_seconds(self) -> float:
        return ray.get(self.actor.busy_seconds.remote(), timeout=STAGE_RESULT_TIMEOUT_S)

    def describe(self) -> dict[str, Any]:
        return ray.get(self.actor.describe.remote(), timeout=30)

    def alive(self, timeout: float) -> bool:
        """Whether the stage's actor answers within ``timeout`` seconds."""
        try:
            return ray.get(self.actor.ping.remote(), timeout=timeout)
        except Exception:  # dead, unreachable or stuck: the replica is not healthy
            return False

    def close(self) -> None:
        ray.kill(self.actor, no_restart=True)
        if self.own_group is not None:
            remove_placement_group(self.own_group)
            self.own_group = None


def stage_bundle(num_cpus: float, num_gpus: float, memory_bytes: int | None) -> dict[str, float]:
    """One stage's placement-group bundle: what one replica of the ``workers`` section reserves."""
    bundle = {"CPU": num_cpus}
    if num_gpus:
        bundle["GPU"] = num_gpus
    if memory_bytes:
        bundle["memory"] = memory_bytes
    return bundle


def start_ray_stages(specs: list[StageSpec], placement: str, bundle: dict[str, float] | None = None,
                     env_vars: dict[str, str] | None = None) -> list[RayStage]:
    """Start the stage actors and wait until each has read its weights. In a Serve replica's
    placement group, stage ``i`` takes bundle ``i + 1``; otherwise a group of ``bundle``s (default
    one CPU each) is made, spread over nodes or packed (``placement``)."""
    if not ray.is_initialized():
        _join_or_start_ray()
    group, first_bundle, owned = get_current_placement_group(), 1, False
    if group is None or group.bundle_count < len(specs) + 1:
        group, first_bundle, owned = _own_group(len(specs), placement, bundle or {"CPU": 1.0}), 0, True
    # Steps run one at a time in their order (the default group: one thread); pings beside them.
    remote = ray.remote(concurrency_groups={"health": 1})(PipelineStageActor)
    actors = []
    for i, spec in enumerate(specs):
        strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=first_bundle + i)
        resources = group.bundle_specs[first_bundle + i]
        actors.append(remote.options(
            num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0), memory=resources.get("memory"),
            scheduling_strategy=strategy, max_restarts=0,
            runtime_env={"env_vars": env_vars} if env_vars else None,
        ).remote(spec))
    stages = [RayStage(actor, spec.span, group if owned and i == len(specs) - 1 else None)
              for i, (actor, spec) in enumerate(zip(actors, specs))]
    for stage in stages:  # (a stage that cannot load fails here, naming its error)
        logger.info("pipeline stage %s", stage.describe())
    return stages


def _own_group(num_stages: int, placement: str, bundle: dict[str, float]) -> PlacementGroup:
    group = placement_group([dict(bundle) for _ in range(num_stages)],
                            strategy="SPREAD" if placement == "spread" else "PACK")
    ray.get(group.ready(), timeout=STAGE_START_TIMEOUT_S)
    return group


def _join_or_start_ray() -> None:
    """The offline ``LLM``'s cluster: the one ``RAY_ADDRESS`` names or one running on this
    machine, else a local one started for this process."""
    apply_local_ray_env()
    try:
        ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False)
    except ConnectionError:
        ray.init(address="local", log_to_driver=False, include_dashboard=False)


def _pool_bytes(kv: Any) -> int:
    return sum(int(leaf.nbytes) for leaf in jax.tree_util.tree_leaves(kv))
