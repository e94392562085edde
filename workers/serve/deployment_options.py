"""The worker deployment's Serve options and their defaults, declared once: the deployment's
decorator, the deploy file's ``workers`` section and the application builder all read them here.
Kept apart from ``workers.serve.deployment`` so the deploy schema can read them without importing Serve."""

from __future__ import annotations

import dataclasses
from typing import Any

DEFAULT_STUCK_AFTER_S = 300.0  # a first compile of a large bucket can take a minute on CPU


@dataclasses.dataclass(frozen=True)
class WorkerDeploymentOptions:
    max_ongoing_requests: int = 128  # requests in flight per replica (the engine batches max_num_seqs)
    max_queued_requests: int = 512  # per router replica; beyond it requests get 503 (-1: no limit)
    graceful_shutdown_timeout_s: float = 30.0
    # Serve notices a crashed replica at its next health check, and only then starts a replacement
    # (the check is cheap: it reads the engine thread's state).
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 30.0

    def serve_options(self) -> dict[str, Any]:
        """As keyword arguments of ``serve.deployment`` / ``Deployment.options``."""
        return dataclasses.asdict(self)
