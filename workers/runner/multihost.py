"""A replica whose mesh spans hosts: the leader's runner relays every launch to the followers.

Under ``jax.distributed`` every process of a mesh must launch the same compiled programs, in
the same order, with the same shapes and inputs (each computes its own shards; the
collectives meet in the middle). Only the leader schedules. Before its runner launches
anything (a warm-up's programs, a step's), it sends the followers a message saying what, and
each follower's runner, built the same way, launches it too (``follow``). Only the leader
reads the results; a follower fetches its copy (replicated outputs, a local read) and drops it.

The messages are plain data that pickles: a step goes as its ``SchedulerOutput``, which
holds nothing the followers cannot rebuild the programs' inputs from, once the rows are
checked for host-side state (``follower_plan``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Protocol

from raylm.workers.core.step_plan import ScheduledRow, SchedulerOutput
from raylm.workers.core.step_result import RunnerOutput
from raylm.workers.runner.model_runner import ModelRunner


@dataclasses.dataclass(frozen=True)
class KvBlocks:
    """The pool sizes the leader chose (a follower's memory may differ; the shapes may not)."""

    counts: tuple[int, int | None]  # the full-attention group's blocks, the sliding group's (or None)


@dataclasses.dataclass(frozen=True)
class Warmup:
    """``ModelRunner.warmup``'s arguments: compile and launch these buckets, with no rows."""

    num_scheduler_steps: int
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    lora_slots: bool


@dataclasses.dataclass(frozen=True)
class Execute:
    """One step: its plan, and the packed buckets the leader's runner must not launch (they
    wait in its background warm-up), which choose how the plan's prompt chunks are grouped."""

    plan: SchedulerOutput
    packed_unavailable: frozenset[int]


@dataclasses.dataclass(frozen=True)
class Stop:
    """The leader closed: the follower leaves its loop."""


Message = KvBlocks | Warmup | Execute | Stop


class Relay(Protocol):
    """How the leader reaches its followers (a pipe, Ray actor calls): in order, not waiting."""

    def send(self, message: Message) -> None: ...


def follower_plan(plan: SchedulerOutput) -> SchedulerOutput:
    """The part of ``plan`` the followers need to build the same programs' inputs: a row's token
    lists go only where penalties read them (else an empty prompt and, of the outputs, their
    count: a step would otherwise carry every running sequence's whole context). A row whose
    next token needs the host (a grammar's mask, logits processors) would launch programs with
    inputs only the leader can compute, and LoRA slots and KV offload fill device memory from
    host state: the engine refuses them (EngineArgs, MultiHostEngine.add_request); this checks."""
    rows = [c.row for c in plan.prefills] + [d.row for d in plan.decodes]
    for row in rows:
        if row.host_before_each_token:
            raise ValueError(f"request {row.request_id!r}: structured output and logits processors are not "
                             "supported on a mesh over several hosts")
    if plan.lora_loads or plan.kv_writes or plan.sliding_kv_writes:
        raise ValueError("LoRA adapters and KV offload are not supported on a mesh over several hosts")
    return dataclasses.replace(plan, prefills=[dataclasses.replace(c, row=_lean(c.row)) for c in plan.prefills],
                               decodes=[dataclasses.replace(d, row=_lean(d.row)) for d in plan.decodes])


def _lean(row: ScheduledRow) -> ScheduledRow:
    """``row`` without the token lists that no program input of it reads (only the outputs'
    count is: the sampler's output index)."""
    if row.params.uses_penalties:
        return row
    return dataclasses.replace(row, prompt_ids=(), output_ids=range(len(row.output_ids)))


class LeaderRunner(ModelRunner):
    """The leader's runner: tells the followers what it launches, then launches it."""

    compiles_off_thread = False  # the followers launch its warm-up in the order of its steps

    def __init__(self, relay: Relay, *args, **kwargs):
        self.relay = relay
        super().__init__(*args, **kwargs)

    def warmup(self, num_scheduler_steps: int, shapes: list[tuple[str, tuple[int, ...]]],
               progress: Callable[[Iterable], Iterable] = lambda x: x, lora_slots: bool = False) -> None:
        self.relay.send(Warmup(num_scheduler_steps, tuple(shapes), lora_slots))
        super().warmup(num_scheduler_steps, shapes, progress, lora_slots)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        self.relay.send(Execute(follower_plan(plan), self.packed_unavailable))
        return super().execute(plan)


def follow(runner: ModelRunner, message: Message) -> bool:
    """A follower's part of one message: launch what the leader launches. False on ``Stop``."""
    if isinstance(message, Stop):
        return False
    if isinstance(message, Warmup):
        runner.warmup(message.num_scheduler_steps, list(message.shapes), lora_slots=message.lora_slots)
    elif isinstance(message, Execute):
        runner.packed_unavailable = message.packed_unavailable
        runner.execute(message.plan)
    else:
        raise TypeError(f"a follower's runner cannot follow {type(message).__name__}")
    return True
