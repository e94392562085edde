"""Speculative decoding counters of a served raylm application, for ``raylm bench`` reports.

The HTTP API says nothing about how many guesses a replica accepted, so the bench asks the
worker replicas themselves (the same stats ``raylm status`` shows) before and after a run and
reports the difference: acceptance rate and accepted guesses per verified step.
"""

from __future__ import annotations

import os
from typing import Any

from deploy.serve_command import LOCAL_RAY_ENV

COUNTERS = ("spec_num_drafts", "spec_draft_tokens", "spec_accepted_tokens")


class SpeculationCounters:
    """Reads the summed counters of every worker replica of ``app`` on the Ray cluster at ``address``."""

    def __init__(self, app: str, address: str = "auto"):
        for key, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(key, value)
        import ray

        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        self.app = app

    def totals(self) -> dict[str, int] | None:
        """Counters summed over replicas; None when no replica speculates (or none answered)."""
        from cluster.replicas import replica_stats

        stats = [s for s in replica_stats(self.app, "LLMWorker").values() if "spec_draft_tokens" in s]
        if not stats:
            return None
        return {key: sum(int(s[key]) for s in stats) for key in COUNTERS}


def acceptance(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, Any]:
    """``spec_acceptance`` (accepted / guessed) and ``spec_mean_accepted`` (per verified step)
    between two readings; None values when speculation was off or nothing was guessed."""
    if before is None or after is None:
        return {"spec_acceptance": None, "spec_mean_accepted": None}
    drafts, tokens, accepted = (after[k] - before[k] for k in COUNTERS)
    return {
        "spec_acceptance": accepted / tokens if tokens else None,
        "spec_mean_accepted": accepted / drafts if drafts else None,
    }
