"""How a pipelined engine plans its micro-batches.

A replica split into N stages keeps up to N step plans in flight (``PipelineRunner.max_in_flight``):
while the last stage computes plan ``k``, the first computes plan ``k + 1``. A sequence is in at most
one plan at a time (its next token comes from the plan before), so each plan is made with the
sequences of those in flight held out (``Scheduler.schedule``'s ``in_flight``), and each takes about
its share of the active sequences (``max_rows``): plans of even size keep the stages evenly busy,
where a first plan of every sequence would leave the next ones empty (vLLM's virtual engines split
the sequences the same way; its batch queue plans them apart the same way).
"""

from __future__ import annotations

from typing import Collection, Sequence

from raylm.workers.core.scheduler import Scheduler
from raylm.workers.core.step_plan import SchedulerOutput


def micro_batch_bounds(scheduler: Scheduler, in_flight: Collection[Sequence], max_in_flight: int
                       ) -> tuple[frozenset[int], int | None]:
    """``Scheduler.schedule``'s ``(in_flight, max_rows)`` for the next plan, given the plans in
    flight (``(plan, ...)`` tuples): nothing held and no cap for a runner of one plan at a time."""
    if max_in_flight == 1:
        return frozenset(), None
    held = frozenset(seq_id for plan, *_ in in_flight for seq_id in plan_sequences(plan))
    active = len(scheduler.running) + len(scheduler.waiting)
    return held, max(1, -(-active // max_in_flight))


def plan_sequences(plan: SchedulerOutput) -> set[int]:
    """The ids of the sequences a plan computes."""
    return {c.row.seq_id for c in plan.prefills} | {d.row.seq_id for d in plan.decodes}
