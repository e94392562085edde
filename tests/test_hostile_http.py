"""The served application under hostile input and mass cancellation, over real HTTP.

Seeded hostile requests (``tests/hostile_requests.py``) and a mixed load a third of which is
abandoned mid-stream or by client timeout go to the shared two-replica app. Every answer must
pass ``check_answer`` (no 5xx but 503 with Retry-After, OpenAI error JSON, well-formed
successes), and afterwards the router holds no slot, every worker replica is idle with no KV
block in use, and a greedy request answers exactly as before.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from cluster.replicas import replica_stats
from tests.hostile_requests import CHAT, check_answer, generate

HOSTILE_REQUESTS = 300  # the soak benchmark sends 10,000
LOAD_REQUESTS = 150  # the soak benchmark sends 1,000


def _router_status(app) -> dict:
    from ray import serve

    return serve.get_deployment_handle("OpenAIRouter", app_name=app.config.name).queue_status.remote().result(
        timeout_s=30)


def assert_back_to_baseline(app, timeout_s: float = 60.0) -> None:
    """Router slots and queue at zero, every worker replica idle with no KV block in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        router = _router_status(app)
        workers = replica_stats(app.config.name)
        idle = workers and all(s["running"] == 0 and s["waiting"] == 0 and s["num_used_blocks"] == 0
                               for s in workers.values())
        if router["in_flight"] == 0 and router["leases"] == 0 and not any(router["queued"].values()) and idle:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"resources still held: router {router}, workers {workers}")
        time.sleep(0.2)


def _greedy(app) -> str:
    body = {"model": app.model, "messages": [{"role": "user", "content": "Name a colour."}], "temperature": 0,
            "max_tokens": 12}
    response = httpx.post(f"{app.base_url}{CHAT}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


async def send_hostile(base_url: str, requests, concurrency: int = 16) -> tuple[list[str], dict[int, int]]:
    """Send ``requests``; returns the problems found and the count of each status."""
    problems: list[str] = []
    statuses: dict[int, int] = {}
    limit = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, request) -> None:
        async with limit:
            try:
                response = await client.request(request.method, f"{base_url}{request.path}", content=request.body,
                                                headers=request.headers)
            except httpx.HTTPError as err:
                problems.append(f"transport error {err!r} for {request.describe()}")
                return
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            problem = check_answer(request, response.status_code, dict(response.headers), response.content)
            if problem:
                problems.append(problem)

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:
        await asyncio.gather(*(one(client, r) for r in requests))
    return problems, statuses


def test_hostile_requests_leave_the_server_as_it_was(raylm_app):
    before = _greedy(raylm_app)
    requests = generate(HOSTILE_REQUESTS, raylm_app.model, seed=2026,
                        max_request_bytes=raylm_app.config.router.max_request_bytes)
    problems, statuses = asyncio.run(send_hostile(raylm_app.base_url, requests))
    assert not problems, "\n".join(problems[:10])
    assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 100, statuses
    assert_back_to_baseline(raylm_app)
    assert _greedy(raylm_app) == before


async def mixed_load(base_url: str, model: str, count: int, seed: int, concurrency: int = 24) -> dict[str, list]:
    """``count`` requests, streaming and not; a third abandoned mid-stream or by client timeout.
    Returns latencies of the completed ones and the problems of any that should have succeeded."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)
    out: dict[str, list] = {"latencies": [], "problems": [], "cancelled": [], "refused": []}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        stream, cancel = rng.random() < 0.5, rng.random() < 1 / 3
        body = {"model": model, "prompt": [rng.randrange(100, 40000) for _ in range(rng.randrange(4, 60))],
                "max_tokens": rng.choice([4, 16, 64]), "ignore_eos": True, "temperature": rng.choice([0, 0.8]),
                "stream": stream}
        async with limit:
            start = time.monotonic()
            try:
                if stream:
                    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
                        if response.status_code != 200:
                            await response.aread()
                            return _refused(out, response, i)
                        events = 0
                        async for line in response.aiter_lines():
                            events += line.startswith("data: ")
                            if cancel and events >= 2:
                                out["cancelled"].append(i)
                                return  # hang up mid-stream
                            if line.startswith("data: ") and '"error"' in line:
                                out["problems"].append(f"request {i}: error event {line[:200]}")
                        if events == 0:
                            out["problems"].append(f"request {i}: empty stream")
                else:
                    timeout = httpx.Timeout(0.3 if cancel else 120)
                    try:
                        response = await client.post(f"{base_url}/v1/completions", json=body, timeout=timeout)
                    except httpx.TimeoutException:
                        out["cancelled"].append(i)
                        return
                    if response.status_code != 200:
                        return _refused(out, response, i)
                out["latencies"].append(time.monotonic() - start)
            except httpx.HTTPError as err:
                out["problems"].append(f"request {i}: {err!r}")

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:
        await asyncio.gather(*(one(client, i) for i in range(count)))
    return out


def _refused(out: dict[str, list], response: httpx.Response, i: int) -> None:
    """Overload may refuse a request, but only fast and with Retry-After."""
    if response.status_code in (429, 503) and response.headers.get("retry-after"):
        out["refused"].append(i)
    else:
        out["problems"].append(f"request {i}: {response.status_code} {response.text[:200]}")


def test_mixed_load_with_cancellations_leaks_nothing(raylm_app):
    result = asyncio.run(mixed_load(raylm_app.base_url, raylm_app.model, LOAD_REQUESTS, seed=7))
    assert not result["problems"], result["problems"][:10]
    assert len(result["cancelled"]) > LOAD_REQUESTS // 5 and len(result["latencies"]) > LOAD_REQUESTS // 3, {
        k: len(v) for k, v in result.items()}
    assert_back_to_baseline(raylm_app)
