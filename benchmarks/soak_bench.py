"""Soak: hostile requests, mixed load with cancellations, and a killed worker, on a served deploy file.

Three phases against one served application on a private local Ray cluster, each followed by a
check that every resource counter is back at its baseline (router slots and queue, worker
running / waiting requests and KV blocks) and that a greedy request answers as before:

1. fuzz: ``--fuzz`` seeded hostile requests (``hostile_requests.py``) at ``--concurrency``;
   reports the statuses seen, the answers that broke the rules (5xx other than 503 with
   Retry-After, non-OpenAI error bodies, malformed successes; goal 0) and leaks (goal 0);
2. load: ``--load`` mixed streaming / non-streaming requests, a third abandoned mid-stream or by
   client timeout; reports completed / cancelled / refused / errors, p50 / p99 latency, leaks;
3. fault: SIGKILL of the worker replica's process under ``--streams`` long streams; reports the
   streams in flight, how each ended, the longest time to end after the kill, and the seconds
   until the replacement replica serves.

The test suite runs the same drivers at a smaller scale (tests/router/test_hostile_http.py,
tests/router/test_faults.py); tests/router/test_adversarial_http.py and
tests/router/test_load_cancel.py add exact answers per hostile case and cancellations at every
stage.

    python -m raylm.benchmarks.soak_bench [--config deploy/default.yaml] [--fuzz 10000] [--load 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import time

import httpx

from raylm.benchmarks.hostile_requests import HostileRequest, check_answer, generate
from raylm.benchmarks.local_serve import local_serve
from raylm.cluster.names import ROUTER_DEPLOYMENT, WORKER_DEPLOYMENT
from raylm.deploy.config import load_deploy_config

COMPLETIONS = "/v1/completions"


# -- drivers (also used by the tests) -----------------------------------------------------------------
async def send_hostile(base_url: str, requests: list[HostileRequest], concurrency: int = 16
                       ) -> tuple[list[str], dict[int, int]]:
    """Send ``requests``; returns the rule-breaking answers found and the count of each status."""
    problems: list[str] = []
    statuses: dict[int, int] = {}
    limit = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, request: HostileRequest) -> None:
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


async def mixed_load(base_url: str, model: str, count: int, seed: int, concurrency: int = 24) -> dict[str, list]:
    """``count`` requests, streaming and not; a third abandoned mid-stream or by client timeout.
    Returns the latencies of completed ones, the ids cancelled and refused (429/503 with
    Retry-After), and the problems of any that should have succeeded."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)
    out: dict[str, list] = {"latencies": [], "problems": [], "cancelled": [], "refused": []}

    def refused(response: httpx.Response, i: int) -> None:
        if response.status_code in (429, 503) and response.headers.get("retry-after"):
            out["refused"].append(i)
        else:
            out["problems"].append(f"request {i}: {response.status_code} {response.text[:200]}")

    async def one(client: httpx.AsyncClient, i: int) -> None:
        stream, cancel = rng.random() < 0.5, rng.random() < 1 / 3
        body = {"model": model, "prompt": [rng.randrange(100, 40000) for _ in range(rng.randrange(4, 60))],
                "max_tokens": rng.choice([4, 16, 64]), "ignore_eos": True, "temperature": rng.choice([0, 0.8]),
                "stream": stream}
        async with limit:
            start = time.monotonic()
            try:
                if stream:
                    async with client.stream("POST", f"{base_url}{COMPLETIONS}", json=body) as response:
                        if response.status_code != 200:
                            await response.aread()
                            return refused(response, i)
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
                    try:
                        response = await client.post(f"{base_url}{COMPLETIONS}", json=body,
                                                     timeout=httpx.Timeout(0.3 if cancel else 120))
                    except httpx.TimeoutException:
                        out["cancelled"].append(i)
                        return
                    if response.status_code != 200:
                        return refused(response, i)
                out["latencies"].append(time.monotonic() - start)
            except httpx.HTTPError as err:
                out["problems"].append(f"request {i}: {err!r}")

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:
        await asyncio.gather(*(one(client, i) for i in range(count)))
    return out


def router_ledgers(app_name: str, timeout_s: float = 30.0) -> dict[str, dict]:
    """``{router replica id: queue_status()}`` for every router replica, each asked directly
    (replicas that died or are still starting are left out).

    A deployment handle answers from one replica of its choosing, so with several router
    replicas a leak in another would go unseen. Serve does not expose a per-replica call, so
    this runs ``queue_status`` inside each replica actor (``__ray_call__``) through Serve's
    replica internals (Ray 2.x: ``ReplicaActor._replica_impl._user_callable_wrapper``)."""
    import ray

    from raylm.cluster.replicas import SERVE_NAMESPACE, replica_actor_names

    def ask(actor) -> dict | None:  # runs in the replica's process; None while it is still starting
        router = actor._replica_impl._user_callable_wrapper.user_callable
        return router.service.queue_status() if hasattr(router, "service") else None

    refs = {}
    for name in replica_actor_names(app_name, ROUTER_DEPLOYMENT):
        try:
            refs[name.rsplit("#", 1)[1]] = ray.get_actor(name, namespace=SERVE_NAMESPACE).__ray_call__.remote(ask)
        except ValueError:  # the replica went away between listing and lookup
            continue
    out = {}
    for replica_id, ref in refs.items():
        try:
            status = ray.get(ref, timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # died, or a replacement starting
            continue
        if status is not None:
            out[replica_id] = status
    return out


def held_resources(app_name: str) -> dict:
    """What the application holds right now, summed over every router replica (slots, leases,
    queued requests) and every worker replica (running / waiting requests, KV blocks)."""
    from raylm.workers.wire.replica_protocol import replica_reports

    routers = router_ledgers(app_name)
    workers = {rid: r.engine for rid, r in replica_reports(app_name).items()}
    return {
        "router_replicas": len(routers),
        "router_slots": sum(r["in_flight"] for r in routers.values()),
        "router_leases": sum(r["leases"] for r in routers.values()),
        "router_queued": sum(sum(r["queued"].values()) for r in routers.values()),
        "worker_replicas": len(workers),
        "worker_requests": sum(s.running + s.waiting for s in workers.values()),
        "worker_blocks": sum(s.pool.num_used_blocks for s in workers.values()),
    }


def wait_back_to_baseline(app_name: str, timeout_s: float = 60.0) -> dict:
    """Wait until nothing is held (requests drain asynchronously); returns what is still held at the
    deadline (all zeros when clean, with ``router_replicas`` and ``worker_replicas`` > 0: a
    replica that did not answer holds nothing in the sums, so an empty answer is not clean)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = held_resources(app_name)
        counts = ("router_replicas", "worker_replicas")
        clean = all(held[k] > 0 for k in counts) and not any(v for k, v in held.items() if k not in counts)
        if clean or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def greedy_answer(base_url: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Name a colour."}], "temperature": 0,
            "max_tokens": 12}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def replica_pid(app_name: str, deployment: str) -> int:
    """The PID of one of the deployment's replica processes, asked of the replica actor itself: a
    process title (``ray::ServeReplica:APP:DEPLOYMENT``) may also match a replica of another Ray
    cluster on the same machine."""
    import ray

    from raylm.cluster.replicas import SERVE_NAMESPACE, replica_actor_names

    names = replica_actor_names(app_name, deployment)
    if not names:
        raise RuntimeError(f"no replica of {app_name}/{deployment} in this Ray cluster")
    actor = ray.get_actor(names[0], namespace=SERVE_NAMESPACE)
    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=30)


def kill_replica(app_name: str, deployment: str) -> int:
    """SIGKILL one replica's process (as the OOM killer or a crash would); returns its PID."""
    pid = replica_pid(app_name, deployment)
    os.kill(pid, signal.SIGKILL)
    return pid


async def long_stream(client: httpx.AsyncClient, base_url: str, model: str, first_chunk: asyncio.Event
                      ) -> tuple[str, float]:
    """One long stream; returns how it ended ("error-event", "status NNN", "clean", "cut",
    "transport ...") and when (monotonic)."""
    body = {"model": model, "prompt": [1000 + i for i in range(20)], "max_tokens": 900, "ignore_eos": True,
            "stream": True}
    try:
        async with client.stream("POST", f"{base_url}{COMPLETIONS}", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return f"status {response.status_code}", time.monotonic()
            ending = "cut"
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    first_chunk.set()
                    if '"error"' in line:
                        ending = "error-event"
                    elif line == "data: [DONE]" and ending != "error-event":
                        ending = "clean"
            return ending, time.monotonic()
    except httpx.HTTPError as err:
        return f"transport {type(err).__name__}", time.monotonic()


async def kill_worker_under_streams(app_name: str, base_url: str, model: str, streams: int
                                    ) -> tuple[list[str], float, float]:
    """Kill the worker replica while ``streams`` long streams run; returns how each ended, the
    seconds from the kill to the last end, and the kill's monotonic time."""
    first_chunk = asyncio.Event()
    async with httpx.AsyncClient(timeout=120) as client:
        tasks = [asyncio.create_task(long_stream(client, base_url, model, first_chunk)) for _ in range(streams)]
        await asyncio.wait_for(first_chunk.wait(), 120)
        await asyncio.sleep(1.0)
        killed_at = time.monotonic()
        await asyncio.to_thread(kill_replica, app_name, WORKER_DEPLOYMENT)
        endings = await asyncio.gather(*tasks)
    return [kind for kind, _ in endings], max(t for _, t in endings) - killed_at, killed_at


def serves(base_url: str, model: str) -> bool:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    try:
        response = httpx.post(f"{base_url}{COMPLETIONS}", json=body, timeout=30)
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and bool(response.json()["choices"][0]["text"])


def seconds_until_serving(base_url: str, model: str, since: float, timeout_s: float) -> float:
    while not serves(base_url, model):
        if time.monotonic() - since > timeout_s:
            raise TimeoutError(f"not serving again within {timeout_s} s")
        time.sleep(0.5)
    return time.monotonic() - since


# -- the benchmark ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deploy/default.yaml")
    parser.add_argument("--fuzz", type=int, default=10_000)
    parser.add_argument("--load", type=int, default=1_000)
    parser.add_argument("--streams", type=int, default=8, help="long streams in flight when the worker is killed")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8013)
    args = parser.parse_args(argv)
    config = load_deploy_config(args.config)

    from ray import serve

    from raylm.deploy.app_builder import build_application
    from raylm.deploy.readiness import wait_healthy

    app, model = config.name, config.served_model_name
    with local_serve(args.port) as base_url:
        serve.run(build_application(config), name=app, route_prefix="/")
        wait_healthy(base_url)
        before = greedy_answer(base_url, model)

        started = time.monotonic()
        requests = generate(args.fuzz, model, args.seed, config.router.max_request_bytes)
        problems, statuses = asyncio.run(send_hostile(base_url, requests, args.concurrency))
        fuzz_s = time.monotonic() - started
        held = wait_back_to_baseline(app)
        print(f"\nfuzz: {len(requests)} requests in {fuzz_s:.0f} s; statuses {dict(sorted(statuses.items()))}")
        print(f"fuzz: 5xx {sum(n for s, n in statuses.items() if s >= 500)} (503 with Retry-After allowed), "
              f"rule-breaking answers {len(problems)} (goal 0); held after: {held}; "
              f"greedy unchanged: {greedy_answer(base_url, model) == before}")
        for problem in problems[:10]:
            print(f"  {problem}")

        started = time.monotonic()
        load = asyncio.run(mixed_load(base_url, model, args.load, args.seed, concurrency=24))
        load_s = time.monotonic() - started
        held = wait_back_to_baseline(app)
        latencies = sorted(load["latencies"])
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else float("nan")
        print(f"\nload: {args.load} requests in {load_s:.0f} s; completed {len(latencies)}, cancelled "
              f"{len(load['cancelled'])}, refused (429/503) {len(load['refused'])}, errors {len(load['problems'])}; "
              f"latency p50 {statistics.median(latencies) if latencies else float('nan'):.2f} s, p99 {p99:.2f} s")
        print(f"load: held after drain: {held} (goal all 0); greedy unchanged: {greedy_answer(base_url, model) == before}")
        for problem in load["problems"][:10]:
            print(f"  {problem}")

        endings, longest, killed_at = asyncio.run(kill_worker_under_streams(app, base_url, model, args.streams))
        back = seconds_until_serving(base_url, model, killed_at, 600)
        failed = sum(not (kind == "error-event" or kind.startswith("status 5")) for kind in endings)
        print(f"\nfault: worker replica killed with {len(endings)} streams in flight; endings {endings}")
        held = wait_back_to_baseline(app)
        print(f"fault: longest time to end {longest:.1f} s; streams without a clear error {failed} (goal 0); "
              f"serving again after {back:.1f} s; greedy unchanged: {greedy_answer(base_url, model) == before}")
        print(f"fault: held after recovery: {held} (goal all 0)")


if __name__ == "__main__":
    main()
