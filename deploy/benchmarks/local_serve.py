"""A private local Ray cluster with Serve for one benchmark script, always torn down after.

Benchmarks start their own cluster (rather than attach to one) so nothing else competes for the
CPU while they measure; the HTTP proxy listens on ``127.0.0.1:port``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from deploy.serve_command import LOCAL_RAY_ENV


@contextlib.contextmanager
def local_serve(port: int, num_cpus: int = 4) -> Iterator[str]:
    """Start Ray and Serve; yields the HTTP base URL; shuts both down on exit."""
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    import ray
    from ray import serve

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
