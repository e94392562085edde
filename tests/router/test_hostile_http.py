"""The served application under seeded hostile requests, over real HTTP.

The soak benchmark's generator and driver, at a smaller scale, against the shared two-replica
app (mass cancellation is ``test_load_cancel.py``; exact answers per case are
``test_adversarial_http.py``). Every answer must pass ``check_answer`` (no 5xx but 503 with Retry-After, OpenAI error
JSON, well-formed successes), and afterwards the router holds no slot, every worker replica is
idle with no KV block in use, and a greedy request answers exactly as before.
"""

from __future__ import annotations

import asyncio

from raylm.benchmarks.hostile_requests import generate
from raylm.benchmarks.soak_bench import greedy_answer, send_hostile, wait_back_to_baseline

HOSTILE_REQUESTS = 300  # the soak benchmark sends 10,000
NOTHING_HELD = {"router_replicas": 1, "router_slots": 0, "router_leases": 0, "router_queued": 0,
                "worker_replicas": 2, "worker_requests": 0, "worker_blocks": 0}


def test_hostile_requests_leave_the_server_as_it_was(raylm_app):
    before = greedy_answer(raylm_app.base_url, raylm_app.model)
    requests = generate(HOSTILE_REQUESTS, raylm_app.model, seed=2026,
                        max_request_bytes=raylm_app.config.router.max_request_bytes)
    problems, statuses = asyncio.run(send_hostile(raylm_app.base_url, requests))
    assert not problems, "\n".join(problems[:10])
    assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 100, statuses
    assert wait_back_to_baseline(raylm_app.config.name) == NOTHING_HELD
    assert greedy_answer(raylm_app.base_url, raylm_app.model) == before
