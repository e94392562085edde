"""Wait until a served application answers ``/health`` (router up, a worker replica reporting).

``serve.run`` returns once the replicas' constructors finished, but the HTTP proxy may not
route to the app yet and the router may not have read any worker's capacity: a request sent
then waits or fails. ``raylm serve``, the benchmarks and the tests wait here first.
"""

from __future__ import annotations

import time

import httpx


def wait_healthy(base: str, timeout_s: float = 180.0) -> None:
    """Poll ``{base}/health`` until it answers 200; TimeoutError with the last answer otherwise."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(f"{base}/health", timeout=10)
            if last.status_code == 200:
                return
        except httpx.HTTPError as err:
            last = err
        time.sleep(0.5)
    raise TimeoutError(f"{base} did not become healthy: {last}")
