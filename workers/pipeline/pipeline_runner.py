"""The engine's runner for a replica split into pipeline stages.

``PipelineRunner`` stands where a ``ModelRunner`` stands (``execute``, warm-up, buckets, expert
load): the scheduler runs once, in the engine, and each step's plan goes to every stage. The
stages before the last run as ``StageHandle``s (in this process, or Ray actors on other nodes:
``workers/pipeline/ray_stages.py``) and hand their residual streams on, stage to stage: a Ray
stage's output goes to the next stage as an object reference, node to node, never through the
engine. The last stage runs in the engine's process, where the sequences' grammar matchers,
logits processors and sampling parameters live, and returns the step's ``RunnerOutput``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterable, Protocol

import numpy as np

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.flop_count import ModelFlops
from raylm.workers.core.step_plan import SchedulerOutput
from raylm.workers.core.step_result import RunnerOutput
from raylm.workers.pipeline.stage_runners import HiddenStageRunner, LastStageRunner, StageSpan, stage_plan


class StageHandle(Protocol):
    """A stage before the last, wherever it runs."""

    span: StageSpan

    def run(self, plan: SchedulerOutput, hidden: Any, packed_unavailable: frozenset[int]) -> Any:
        """Start the stage on ``plan`` (its ``stage_plan``) from the previous stage's output
        ``hidden`` (what that stage's ``run`` returned: host arrays, or a reference to them);
        return its own."""

    def resolve(self, output: Any) -> list[np.ndarray]:
        """``run``'s output as host arrays (waits for it)."""

    def warmup(self, num_scheduler_steps: int, shapes: list[tuple[str, tuple[int, ...]]], lora_slots: bool) -> Any:
        """Compile ``shapes``; returns something ``wait`` waits for (stages compile at once)."""

    def wait(self, pending: Any) -> None: ...

    def take_expert_load(self) -> np.ndarray | None: ...

    def matrix_params(self, config: ModelConfig) -> int:
        """Weights a token multiplies in the stage's layers (``ModelFlops.matrix_params``)."""

    def busy_seconds(self) -> float:
        """Seconds the stage has spent in steps so far."""

    def alive(self, timeout: float) -> bool:
        """Whether the stage answers a ping within ``timeout`` seconds (even while it steps)."""

    def describe(self) -> dict[str, Any]:
        """Where the stage runs and what it holds: index, layers, node id, weight and KV bytes."""

    def close(self) -> None: ...


class LocalStage:
    """A stage in this process (``pipeline_placement: local``: one machine, no Ray); a Ray stage's
    actor is one in its own process (``workers/pipeline/ray_stages.py``)."""

    def __init__(self, runner: HiddenStageRunner, span: StageSpan):
        self.runner, self.span = runner, span

    def run(self, plan: SchedulerOutput, hidden: Any, packed_unavailable: frozenset[int]) -> list[np.ndarray]:
        self.runner.packed_unavailable = packed_unavailable
        return self.runner.run(plan, hidden)

    def resolve(self, output: list[np.ndarray]) -> list[np.ndarray]:
        return output

    def warmup(self, num_scheduler_steps: int, shapes: list[tuple[str, tuple[int, ...]]], lora_slots: bool) -> None:
        self.runner.warmup(num_scheduler_steps, shapes, lora_slots=lora_slots)

    def wait(self, pending: Any) -> None:
        pass

    def take_expert_load(self) -> np.ndarray | None:
        return self.runner.take_expert_load()

    def matrix_params(self, config: ModelConfig) -> int:
        return self.runner.model_flops(config).matrix_params

    def busy_seconds(self) -> float:
        return self.runner.busy_seconds

    def alive(self, timeout: float) -> bool:
        return True

    def describe(self) -> dict[str, Any]:
        return {"stage": self.span.index, "layers": [self.span.start, self.span.stop], "node_id": None,
                "pid": os.getpid()}

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A plan started on the stages before the last: their output so far (a stage's ``run``
    result), and the packed prompt buckets the launches were grouped without."""

    plan: SchedulerOutput
    output: Any
    packed_unavailable: frozenset[int]


class PipelineRunner:
    """Stages before the last (``stages``) and the last (``last``, this process's)."""

    compiles_off_thread = False  # (the stages warm up by launching: ``warmup``)

    def __init__(self, stages: list[StageHandle], last: LastStageRunner, last_span: StageSpan):
        self.stages, self.last, self.last_span = stages, last, last_span
        self.buckets, self.cpu_kernels, self.block_size = last.buckets, last.cpu_kernels, last.block_size
        self.packed_unavailable: frozenset[int] = frozenset()

    @property
    def spans(self) -> list[StageSpan]:
        return [s.span for s in self.stages] + [self.last_span]

    @property
    def max_in_flight(self) -> int:
        """Plans the engine keeps in the stages at once: one per stage (micro-batches; the engine
        plans them apart: ``Scheduler.schedule``'s ``in_flight``)."""
        return len(self.stages) + 1

    def submit(self, plan: SchedulerOutput) -> InFlight:
        """Start ``plan`` on the stages before the last (a Ray stage's call returns at once, its
        output going on to the next stage node to node); ``finish`` completes it."""
        output: Any = ()
        for stage in self.stages:
            output = stage.run(stage_plan(plan, stage.span), output, self.packed_unavailable)
        return InFlight(plan, output, self.packed_unavailable)

    def finish(self, pending: InFlight) -> RunnerOutput:
        """Wait for the stages before the last and run the last on ``pending``'s plan: its output."""
        hidden = self.stages[-1].resolve(pending.output)
        self.last.packed_unavailable = pending.packed_unavailable  # (the launches of the other stages)
        return self.last.execute_after(pending.plan, hidden, self.last_span)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run ``plan`` through every stage, the last in this process."""
        return self.finish(self.submit(plan))

    # -- what the engine asks of a runner ---------------------------------------------------------
    def warmup_shapes(self, num_scheduler_steps: int) -> list[tuple[str, tuple[int, ...]]]:
        return self.last.warmup_shapes(num_scheduler_steps)

    def first_warmup_shapes(self, num_scheduler_steps: int) -> int:
        return self.last.first_warmup_shapes(num_scheduler_steps)

    def first_packed_bucket(self) -> int:
        return self.last.first_packed_bucket()

    def warmup(self, num_scheduler_steps: int, shapes: list[tuple[str, tuple[int, ...]]],
               progress: Callable[[Iterable], Iterable] = lambda x: x, lora_slots: bool = False) -> None:
        """Compile ``shapes`` on every stage: the others at once, while this one compiles."""
        pending = [(stage, stage.warmup(num_scheduler_steps, shapes, lora_slots)) for stage in self.stages]
        self.last.warmup(num_scheduler_steps, shapes, progress, lora_slots=lora_slots)
        for stage, waiting in pending:
            stage.wait(waiting)

    def model_flops(self, config: ModelConfig) -> ModelFlops:
        """Operations per token of the whole model: every stage's layers' matrices."""
        own = self.last.model_flops(config)
        others = sum(stage.matrix_params(config) for stage in self.stages)
        return dataclasses.replace(own, matrix_params=own.matrix_params + others)

    def take_expert_load(self) -> np.ndarray | None:
        """Tokens routed per (sparse layer, expert) since the last call, every stage's layers in order."""
        loads = [stage.take_expert_load() for stage in self.stages] + [self.last.take_expert_load()]
        loads = [load for load in loads if load is not None]
        return np.concatenate(loads) if loads else None

    def read_hidden_states(self, *args: Any) -> np.ndarray:
        raise RuntimeError("hidden-state extraction is refused with pipeline parallelism (engine arguments)")

    def stage_busy_seconds(self) -> list[float]:
        """Seconds each stage has spent in steps so far, in stage order: over a stretch of wall
        time, one minus a stage's share of it is that stage's bubble fraction."""
        return [stage.busy_seconds() for stage in self.stages] + [self.last.busy_seconds]

    def check_stages(self, timeout: float) -> None:
        """Raise, naming it, if a stage does not answer within ``timeout`` seconds (dead, or its
        node gone): the replica is then unhealthy and Serve replaces it with all its stages."""
        for stage in self.stages:
            if not stage.alive(timeout):
                raise RuntimeError(f"pipeline stage {stage.span.index} (layers {stage.span.start}-"
                                   f"{stage.span.stop - 1}) does not answer")

    def close(self) -> None:
        for stage in self.stages:
            stage.close()


def stage_locations(runner: Any, own_node: str) -> list[dict[str, Any]]:
    """Each stage's index, layers, node and process (the last stage's are ``own_node`` and this
    process), for ``raylm status``; empty for a replica that is not split into stages."""
    if not isinstance(runner, PipelineRunner):
        return []
    located = [{key: stage.describe()[key] for key in ("stage", "layers", "node_id", "pid")} for stage in runner.stages]
    last = runner.last_span
    return located + [{"stage": last.index, "layers": [last.start, last.stop], "node_id": own_node,
                       "pid": os.getpid()}]
