"""Speculative decoding counters of a served raylm application, for ``raylm bench`` reports.

The HTTP API says nothing about how many guesses a replica accepted, so the bench asks the
worker replicas themselves (the same stats ``raylm status`` shows) before and after a run and
reports the difference: acceptance rate and accepted guesses per verified step.
"""

from __future__ import annotations

from typing import Any

from cluster.local_ray import apply_local_ray_env
from workers.speculative import SpecDecodeStats


class SpeculationCounters:
    """Reads the summed counters of every worker replica of ``app`` on the Ray cluster at ``address``."""

    def __init__(self, app: str, address: str = "auto"):
        apply_local_ray_env()
        import ray

        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        self.app = app

    def totals(self) -> SpecDecodeStats | None:
        """Counters summed over replicas; None when no replica speculates (or none answered)."""
        from workers.replica_protocol import replica_reports

        specs = [r.engine.spec for r in replica_reports(self.app).values() if r.engine.spec is not None]
        if not specs:
            return None
        return SpecDecodeStats(sum(s.num_drafts for s in specs), sum(s.num_draft_tokens for s in specs),
                               sum(s.num_accepted_tokens for s in specs))


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
