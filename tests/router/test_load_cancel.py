"""Mixed load with a third of the requests abandoned at every stage: nothing leaks, nothing wedges.

``test_hostile_http.py``'s mixed load abandons one-sequence requests mid-stream or by a short
client timeout. The lease must be given back on every exit path, and the paths differ by where
the request is and how many worker calls it holds, so here the load is above the router's
capacity (some requests wait in the admission queue, some are refused with Retry-After) and the
abandoned requests are spread over every stage and shape:

- stages: waiting in the router's queue or in prefill (a client timeout before the response
  starts), mid-stream (the client closes after the first chunk), waiting for a non-streaming
  answer (a client timeout while it generates);
- shapes: one sequence, ``n=2`` (two sequences, one worker call each), two prompts.

Asserts: every request not abandoned succeeded (a well-formed 200, or 429/503 with
Retry-After); after the drain no router slot, lease or queue entry and no worker request or KV
block is held, the router's capacity is what it was, and a greedy request answers as before.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import threading
import time

import httpx

from raylm.benchmarks.soak_bench import greedy_answer, router_ledgers, wait_back_to_baseline

CONCURRENCY = 28  # ~40 sequences asked at once (n=2, two prompts) exceed the shared app's 32 slots: some wait
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
SHAPES = ["single", "n=2", "two prompts"]
MODES = ["complete", "complete", "complete", "complete", "hang up after the first chunk",
         "time out before the response", "time out while generating"]
# Request i has shape i % 3 and mode i % 7, so every 21 requests hold each (shape, mode) pair once;
# the middle 21 stream, the first and last 21 do not (hanging up after the first chunk always
# streams). The soak benchmark's load phase sends 1,000 random ones.
REQUESTS = 3 * len(SHAPES) * len(MODES)


def _request(rng: random.Random, model: str, i: int) -> tuple[tuple[str, dict], str]:
    shape, mode = SHAPES[i % len(SHAPES)], MODES[i % len(MODES)]
    stream = (i // (len(SHAPES) * len(MODES))) % 2 == 1 or mode == "hang up after the first chunk"
    body: dict = {"model": model, "max_tokens": rng.choice([4, 16, 32]), "ignore_eos": True,
                  "temperature": rng.choice([0, 0.8]), "stream": stream}
    if shape == "two prompts":
        body["prompt"] = [[rng.randrange(100, 40000) for _ in range(rng.randrange(4, 40))] for _ in range(2)]
        return (COMPLETIONS, body), mode
    if shape == "n=2":
        body["n"] = 2
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": f"Tell me about the number {rng.randrange(10**6)}."}]
        return (CHAT, body), mode
    body["prompt"] = [rng.randrange(100, 40000) for _ in range(rng.randrange(4, 60))]
    return (COMPLETIONS, body), mode


async def _one(client: httpx.AsyncClient, url: str, body: dict, mode: str) -> tuple[str, float, str | None]:
    """Send one request and act out ``mode``; returns (outcome, latency, problem or None). Outcomes:
    "done", "refused" (429/503 with Retry-After), "abandoned"."""
    start = time.monotonic()
    timeout = {"time out before the response": 0.2, "time out while generating": 1.0}.get(mode, 120)
    where = f"{mode}: {json.dumps(body)[:200]}"
    try:
        async with client.stream("POST", url, json=body, timeout=httpx.Timeout(timeout)) as response:
            if response.status_code != 200:
                await response.aread()
                if response.status_code in (429, 503) and response.headers.get("retry-after"):
                    return "refused", 0.0, None
                return "failed", 0.0, f"{response.status_code} {response.text[:200]} for {where}"
            if body["stream"]:
                events = []
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if mode == "hang up after the first chunk":
                            return "abandoned", 0.0, None  # leaving the block closes the connection
                if not events or events[-1] != "[DONE]" or any('"error"' in e for e in events):
                    return "failed", 0.0, f"bad stream {events[-3:]} for {where}"
            else:
                payload = json.loads(await response.aread())
                prompts = len(body["prompt"]) if isinstance(body.get("prompt", [None])[0], list) else 1
                wanted = body.get("n", 1) * prompts
                if len(payload.get("choices", [])) != wanted:
                    return "failed", 0.0, f"{len(payload.get('choices', []))} choices, not {wanted}, for {where}"
    except httpx.TimeoutException:
        if mode.startswith("time out"):
            return "abandoned", 0.0, None
        return "failed", 0.0, f"client timeout after {time.monotonic() - start:.0f} s for {where}"
    except httpx.HTTPError as err:
        return "failed", 0.0, f"{err!r} for {where}"
    return "done", time.monotonic() - start, None


async def _load(base_url: str, model: str, seed: int) -> list[tuple[str, float, str | None]]:
    rng = random.Random(seed)
    plan = [_request(rng, model, i) for i in range(REQUESTS)]
    limit = asyncio.Semaphore(CONCURRENCY)

    async def run(client: httpx.AsyncClient, path: str, body: dict, mode: str):
        async with limit:
            return await _one(client, f"{base_url}{path}", body, mode)

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=CONCURRENCY + 8)) as client:
        return await asyncio.gather(*(run(client, path, body, mode) for (path, body), mode in plan))


class _QueuePeak:
    """Polls the routers' queues in a thread while the load runs; ``queued`` is the peak seen."""

    def __init__(self, app_name: str):
        self.app_name, self.queued = app_name, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            ledgers = router_ledgers(self.app_name, timeout_s=5)
            self.queued = max(self.queued, sum(sum(r["queued"].values()) for r in ledgers.values()))

    def __enter__(self) -> "_QueuePeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def test_an_overload_with_a_third_abandoned_at_every_stage_leaks_nothing(raylm_app):
    before = greedy_answer(raylm_app.base_url, raylm_app.model)
    capacity = {rid: r["capacity"] for rid, r in router_ledgers(raylm_app.config.name).items()}
    started = time.monotonic()
    with _QueuePeak(raylm_app.config.name) as peak:
        results = asyncio.run(_load(raylm_app.base_url, raylm_app.model, seed=18))
    outcomes = {kind: sum(r[0] == kind for r in results) for kind in ("done", "refused", "abandoned", "failed")}
    latencies = sorted(r[1] for r in results if r[0] == "done") or [float("nan")]
    print(f"\nload: {REQUESTS} requests in {time.monotonic() - started:.0f} s: {outcomes}; latency p50 "
          f"{statistics.median(latencies):.2f} s, p99 {latencies[int(0.99 * (len(latencies) - 1))]:.2f} s")
    problems = [r[2] for r in results if r[2]]
    assert not problems, "\n".join(problems[:10])
    assert outcomes["abandoned"] >= REQUESTS // 5 and outcomes["done"] >= REQUESTS // 3, outcomes
    print(f"load: most requests waiting in the router's queue at once: {peak.queued}")
    assert peak.queued > 0, "the load never queued: the abandoned-while-queued path went untested"

    held = wait_back_to_baseline(raylm_app.config.name)
    print(f"load: held after the drain: {held}")
    assert held["router_replicas"] > 0 and held["worker_replicas"] > 0, held
    assert not any(v for k, v in held.items() if not k.endswith("_replicas")), f"leaked: {held}"
    after = {rid: r["capacity"] for rid, r in router_ledgers(raylm_app.config.name).items()}
    assert after == capacity, f"router capacity changed: {capacity} -> {after}"
    assert greedy_answer(raylm_app.base_url, raylm_app.model) == before
