"""A served raylm application's engine counters, for ``raylm bench`` reports.

The HTTP API says nothing about how many guesses a replica accepted or how fast its steps
computed, so the bench asks the worker replicas themselves (the same stats ``raylm status``
shows) before and after a run and reports the difference: speculative decoding's acceptance
here, each step kind's achieved rate in ``step_rates.py``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from raylm.cluster.local_ray import apply_local_ray_env
from raylm.workers.core.engine_stats import ComputeStats, EngineStats, StepWork
from raylm.workers.core.speculation import SpecDecodeStats


@dataclasses.dataclass(frozen=True)
class ReplicaTotals:
    """Counters summed over replicas; each None when no replica reports it (speculation off,
    or no replica answered). ``warmup_programs_left``: programs the replicas still compile in the
    background (0 once every replica serves at full speed); ``replicas``: how many answered."""

    spec: SpecDecodeStats | None
    compute: ComputeStats | None
    warmup_programs_left: int = 0
    replicas: int = 0  # worker replicas that answered


class ReplicaCounters:
    """Reads the summed counters of every worker replica of ``app`` on the Ray cluster at ``address``."""

    def __init__(self, app: str, address: str = "auto"):
        apply_local_ray_env()
        import ray

        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        self.app = app

    def totals(self) -> ReplicaTotals:
        from raylm.workers.wire.replica_protocol import replica_reports

        return sum_replicas([r.engine for r in replica_reports(self.app).values()])

    def warmup_programs_left(self) -> int | None:
        """Programs the worker replicas still compile in the background; None while none answers."""
        totals = self.totals()
        return totals.warmup_programs_left if totals.replicas else None


def sum_replicas(engines: list[EngineStats]) -> ReplicaTotals:
    """The replicas' speculation and step counters, summed."""
    specs = [e.spec for e in engines if e.spec is not None]
    spec = SpecDecodeStats(sum(s.num_drafts for s in specs), sum(s.num_draft_tokens for s in specs),
                           sum(s.num_accepted_tokens for s in specs)) if specs else None
    computes = [e.compute for e in engines if e.compute is not None]
    compute = None
    if computes:
        kinds = {kind: StepWork(*(sum(getattr(c.kinds[kind], f.name) for c in computes)
                                  for f in dataclasses.fields(StepWork)))
                 for kind in computes[0].kinds}
        compute = ComputeStats(any(c.integer_matmuls for c in computes), kinds)
    return ReplicaTotals(spec, compute, sum(e.warmup_programs_left for e in engines), len(engines))


def wait_until_warm(programs_left: Callable[[], int | None], timeout_s: float, *, poll_s: float = 2.0,
                    say: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> bool:
    """Wait until ``programs_left()`` (the replicas' background warm-up) is 0, at most ``timeout_s``;
    whether it got there. A replica answers requests while it compiles its remaining programs,
    on the same cores: a run measured then reports the compiler's time as the server's (a
    single stream at a third of its speed on the bundled model), so the bench waits, and says
    so, rather than print such figures as the server's. None means no worker replica answered
    yet: the router serves ``/v1/models`` before the application's workers have started, and a
    bench started then had measured their start-up and whole warm-up (TTFT 8 s instead of 0.4)."""
    deadline = clock() + timeout_s
    left, announced = programs_left(), None  # the wait last announced: "start" or "warm-up"
    while left != 0:
        wait = "start" if left is None else "warm-up"
        if wait != announced:
            say("waiting for the application's worker replicas to start" if left is None
                else f"waiting for the replicas' warm-up: {left} programs left to compile")
            announced = wait
        if clock() >= deadline:
            state = "no worker replica answered" if left is None else f"still {left} warm-up programs left"
            say(f"warning: {state} after {timeout_s:.0f} s; the figures below include their "
                f"{'start-up' if left is None else 'compilation'}")
            return False
        sleep(poll_s)
        left = programs_left()
    return True


def acceptance(before: SpecDecodeStats | None, after: SpecDecodeStats | None) -> dict[str, Any]:
    """``spec_acceptance`` (accepted / guessed) and ``spec_mean_accepted`` (per verified step)
    between two readings; None values when speculation was off or nothing was guessed."""
    if before is None or after is None:
        return {"spec_acceptance": None, "spec_mean_accepted": None}
    drafts = after.num_drafts - before.num_drafts
    tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return {
        "spec_acceptance": accepted / tokens if tokens else None,
        "spec_mean_accepted": accepted / drafts if drafts else None,
    }
