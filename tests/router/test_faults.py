"""Killing processes under load: a worker replica (SIGKILL) and one of two router replicas.

Runs on its own application (one worker replica, two router replicas) so the shared one is
untouched. Every request in flight on a killed worker must end within a bounded time with a
clear error (an error status, or an SSE error event: never a stream that just stops or ends as
a clean success); the router must give back what those requests held (worker death is an exit
path of the lease too); Serve must start a replacement, which answers a greedy request exactly
as the killed one did. With two router replicas, killing one under concurrent load must leave
the other serving: every request started after the kill succeeds and none hangs. A Responses
API conversation outlives every router process that served it: its turns continue through
``previous_response_id`` on the replicas that replace them (the store is the cluster's). The soak
benchmark runs the worker kill on the deploy file.
"""

from __future__ import annotations

import asyncio
import copy
import time

import httpx
import pytest

from raylm.benchmarks.soak_bench import (
    greedy_answer,
    kill_replica,
    kill_worker_under_streams,
    seconds_until_serving,
    serves,
    wait_back_to_baseline,
)
from tests.serving import TEST_DEPLOY

STREAMS = 6
END_WITHIN_S = 60.0
RECOVER_WITHIN_S = 300.0
LOAD_CLIENTS = 4
AFTER_KILL_REQUESTS = LOAD_CLIENTS * 2  # requests sent after the kill that must all succeed
AFTER_KILL_WITHIN_S = 180.0  # only a stalled service takes this long
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def fault_app(serve_cluster):
    config = copy.deepcopy(TEST_DEPLOY)
    config["name"] = "faults"
    config["workers"].update(num_replicas=1, graceful_shutdown_timeout_s=1)
    config["router"]["num_replicas"] = 2
    app = serve_cluster.deploy(config, route_prefix="/faults")
    yield app
    serve_cluster.remove(app)


def _assert_nothing_held(app) -> None:
    held = wait_back_to_baseline(app.config.name)
    assert held["router_replicas"] > 0 and held["worker_replicas"] > 0, held
    assert not any(v for k, v in held.items() if not k.endswith("_replicas")), f"still held: {held}"


def test_a_killed_worker_fails_its_requests_clearly_and_is_replaced(fault_app):
    assert serves(fault_app.base_url, fault_app.model)
    before = greedy_answer(fault_app.base_url, fault_app.model)
    endings, longest, killed_at = asyncio.run(
        kill_worker_under_streams(fault_app.config.name, fault_app.base_url, fault_app.model, STREAMS))
    print(f"\nworker kill: {STREAMS} streams in flight, endings {endings}, longest {longest:.1f} s after the kill")
    assert all(kind == "error-event" or kind.startswith("status 5") for kind in endings), endings
    assert longest < END_WITHIN_S
    back = seconds_until_serving(fault_app.base_url, fault_app.model, killed_at, RECOVER_WITHIN_S)
    print(f"worker kill: served again {back:.1f} s after the kill")
    _assert_nothing_held(fault_app)
    assert greedy_answer(fault_app.base_url, fault_app.model) == before, "the replacement answers differently"


async def _steady_load(base_url: str, model: str, kill_at: asyncio.Event, stop: asyncio.Event,
                       results: list[tuple[float, float, str]]) -> None:
    """``LOAD_CLIENTS`` clients each sending short requests back to back (streaming and not) until
    ``stop``; appends (start, end, outcome) per request to ``results``, outcome "ok" or what went wrong."""

    async def client_loop(client: httpx.AsyncClient, i: int) -> None:
        sent = 0
        while not stop.is_set():
            stream = (i + sent) % 2 == 0
            body = {"model": model, "prompt": [1000 + 7 * i + sent % 50, 2000, 3000], "max_tokens": 8,
                    "ignore_eos": True, "stream": stream}
            start = time.monotonic()
            try:
                response = await client.post(f"{base_url}{COMPLETIONS}", json=body)
                text = response.text
                ok = response.status_code == 200 and (not stream or (text.rstrip().endswith("data: [DONE]")
                                                                      and '"error"' not in text))
                outcome = "ok" if ok else f"{response.status_code} {text[:160]!r}"
            except httpx.HTTPError as err:
                outcome = f"transport {err!r}"
            results.append((start, time.monotonic(), outcome))
            sent += 1
            if sent == 3:
                kill_at.set()  # every client is under way: time to kill

    async with httpx.AsyncClient(timeout=END_WITHIN_S) as client:
        await asyncio.gather(*(client_loop(client, i) for i in range(LOAD_CLIENTS)))


async def _kill_router_under_load(app) -> tuple[float, list[tuple[float, float, str]]]:
    """Kill a router replica under steady load and keep the load on until ``AFTER_KILL_REQUESTS``
    requests sent after the kill have ended (counted, not timed: a slow machine only takes longer)."""
    kill_at, stop = asyncio.Event(), asyncio.Event()
    results: list[tuple[float, float, str]] = []
    load = asyncio.create_task(_steady_load(app.base_url, app.model, kill_at, stop, results))
    await asyncio.wait_for(kill_at.wait(), 120)
    await asyncio.to_thread(kill_replica, app.config.name, "OpenAIRouter")
    killed_at = time.monotonic()
    deadline = killed_at + AFTER_KILL_WITHIN_S
    while sum(r[0] >= killed_at for r in results) < AFTER_KILL_REQUESTS and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    stop.set()
    await asyncio.wait_for(load, END_WITHIN_S + 30)  # no request may hang
    return killed_at, results


def test_the_other_router_replica_keeps_serving(fault_app):
    from ray import serve

    seconds_until_serving(fault_app.base_url, fault_app.model, time.monotonic(), RECOVER_WITHIN_S)
    status = serve.status().applications[fault_app.config.name].deployments["OpenAIRouter"]
    assert status.replica_states.get("RUNNING") == 2, status
    killed_at, results = asyncio.run(_kill_router_under_load(fault_app))
    at_kill = [r for r in results if r[0] < killed_at < r[1]]
    after = [r for r in results if r[0] >= killed_at]
    failed_after = [f"{r[0] - killed_at:+.1f} s: {r[2]}" for r in after if r[2] != "ok"]
    print(f"\nrouter kill: {len(at_kill)} requests in flight at the kill ({sum(r[2] == 'ok' for r in at_kill)} "
          f"served, longest ended {max((r[1] - killed_at for r in at_kill), default=0):.1f} s after); "
          f"{len(after)} sent after it, {len(failed_after)} failed")
    assert len(after) >= AFTER_KILL_REQUESTS, f"the load stalled after the kill: {len(after)} requests"
    assert not failed_after, "\n".join(failed_after[:10])
    seconds_until_serving(fault_app.base_url, fault_app.model, killed_at, RECOVER_WITHIN_S)
    _assert_nothing_held(fault_app)


def _kill_every_router_replica(app_name: str) -> list[int]:
    """SIGKILL every router replica's process; their PIDs."""
    import os
    import signal

    import ray

    from raylm.cluster.replicas import SERVE_NAMESPACE, replica_actor_names

    pids = []
    for name in replica_actor_names(app_name, "OpenAIRouter"):
        actor = ray.get_actor(name, namespace=SERVE_NAMESPACE)
        pids.append(ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=30))
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


def _wait_for_both_routers(app_name: str, since: float) -> None:
    """Until Serve reports both router replicas RUNNING and both are listed as live actors."""
    from raylm.cluster.replicas import replica_actor_names, running_replicas

    while running_replicas(app_name, "OpenAIRouter") < 2 or len(replica_actor_names(app_name, "OpenAIRouter")) < 2:
        assert time.monotonic() - since < RECOVER_WITHIN_S, "the router replicas were not (re)started"
        time.sleep(0.5)


def test_a_responses_conversation_outlives_the_router_replicas_that_served_it(fault_app):
    from openai import OpenAI

    _wait_for_both_routers(fault_app.config.name, time.monotonic())  # the previous test killed one
    seconds_until_serving(fault_app.base_url, fault_app.model, time.monotonic(), RECOVER_WITHIN_S)
    client = OpenAI(base_url=f"{fault_app.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    first = client.responses.create(model=fault_app.model, input="Name a colour.", max_output_tokens=8,
                                    temperature=0)
    killed = _kill_every_router_replica(fault_app.config.name)
    assert len(killed) == 2
    killed_at = time.monotonic()
    _wait_for_both_routers(fault_app.config.name, killed_at)
    seconds_until_serving(fault_app.base_url, fault_app.model, killed_at, RECOVER_WITHIN_S)
    # Every turn from here is served by a process that did not exist when the first was stored;
    # each answers as a chat completion given the whole conversation does (greedy, so the same text).
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": first.output_text}]
    previous = first.id
    for question in ("And another?", "Which of the two is darker?"):
        turn = client.responses.create(model=fault_app.model, input=question, previous_response_id=previous,
                                       max_output_tokens=8, temperature=0)
        messages.append({"role": "user", "content": question})
        chat = client.chat.completions.create(model=fault_app.model, messages=messages, max_tokens=8, temperature=0)
        assert turn.output_text == chat.choices[0].message.content, messages
        messages.append({"role": "assistant", "content": turn.output_text})
        previous = turn.id
    assert client.responses.retrieve(first.id).output_text == first.output_text

