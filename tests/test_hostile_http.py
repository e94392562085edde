"""The served application under hostile input and mass cancellation, over real HTTP.

Seeded hostile requests and a mixed load a third of which is abandoned mid-stream or by client
timeout go to the shared two-replica app (the drivers are the soak benchmark's, at a smaller
scale). Every answer must pass ``check_answer`` (no 5xx but 503 with Retry-After, OpenAI error
JSON, well-formed successes), and afterwards the router holds no slot, every worker replica is
idle with no KV block in use, and a greedy request answers exactly as before.
"""

from __future__ import annotations

import asyncio

from deploy.benchmarks.hostile_requests import generate
from deploy.benchmarks.soak_bench import greedy_answer, mixed_load, send_hostile, wait_back_to_baseline

HOSTILE_REQUESTS = 300  # the soak benchmark sends 10,000
LOAD_REQUESTS = 150  # the soak benchmark sends 1,000
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


def test_mixed_load_with_cancellations_leaks_nothing(raylm_app):
    result = asyncio.run(mixed_load(raylm_app.base_url, raylm_app.model, LOAD_REQUESTS, seed=7))
    assert not result["problems"], result["problems"][:10]
    counts = {k: len(v) for k, v in result.items()}
    assert counts["cancelled"] > LOAD_REQUESTS // 5 and counts["latencies"] > LOAD_REQUESTS // 3, counts
    assert wait_back_to_baseline(raylm_app.config.name) == NOTHING_HELD
