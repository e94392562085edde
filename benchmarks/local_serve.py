"""A private local Ray cluster with Serve for one benchmark script, always torn down after.

Benchmarks start their own cluster (rather than attach to one) so nothing else competes for the
CPU while they measure; the HTTP proxy listens on ``127.0.0.1:port``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from raylm.cluster.local_ray import apply_local_ray_env


@contextlib.contextmanager
def local_serve(port: int, num_cpus: int = 4, metrics_port: int | None = None) -> Iterator[str]:
    """Start Ray and Serve; yields the HTTP base URL; shuts both down on exit.

    With ``metrics_port``, Ray's metrics endpoint listens there and processes report every
    second (not every ten), so a benchmark can read counters right after a run.
    """
    apply_local_ray_env()
    if metrics_port is not None:
        os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    import ray
    from ray import serve

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, _metrics_export_port=metrics_port)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
