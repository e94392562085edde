"""Prefill/decode disaggregation end to end: one prefill and one decode replica of a tiny model
on the session's Ray cluster, against a colocated deployment of the same model.

Greedy streams equal the colocated deployment's token for token; usage counts the prompt once
and, as cached, the full blocks the decode replica loaded from the cluster tier (it never saw
the prompt: only a handoff put them there); ``raylm status`` shows each replica's role; clients
that go away at any point of a request (during its prefill, its load, its decode) leave no
request and no KV block held on either replica, nor anything in the router; the router times
each prefill hop; a killed prefill replica costs a request at most a recompute on the decode
replica (the same tokens), never an error.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from raylm.benchmarks.soak_bench import kill_replica, wait_back_to_baseline
from raylm.cluster.names import PREFILL_WORKER_DEPLOYMENT
from tests.checkpoints import build_tiny_checkpoint

MODEL = "pd-tiny"  # the metrics of this module's applications alone carry it
BLOCK = 16
ENGINE = {"num_kv_blocks": 96, "block_size": BLOCK, "max_num_seqs": 4, "max_num_batched_tokens": 64,
          "max_model_len": 256, "compilation_cache_dir": "~/.cache/raylm/jax"}
WORKERS = {"num_replicas": 1, "num_cpus": 1, "graceful_shutdown_timeout_s": 1}


def _prompt(seed: int, length: int) -> list[int]:
    """Token ids no other test prompt shares a first block with (vocab 320, ids 3.. past the specials)."""
    return [3 + (seed * 131 + i * 17) % 300 for i in range(length)]


@pytest.fixture(scope="module")
def apps(serve_cluster, tmp_path_factory):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path_factory.mktemp("pd-serving") / "m")
    model = {"name": str(path), "served_model_name": MODEL}
    colocated = serve_cluster.deploy({"name": "pd-colocated", "model": model, "workers": WORKERS, "engine": ENGINE},
                                     route_prefix="/pd-colocated")
    disaggregated = serve_cluster.deploy({
        "name": "pd", "model": model, "workers": WORKERS, "prefill_workers": {**WORKERS, "timeout_s": 10},
        "engine": {**ENGINE, "kv_offload": {"cluster_bytes": 64 << 20}},
    }, route_prefix="/pd")
    yield colocated, disaggregated
    serve_cluster.remove(disaggregated)
    serve_cluster.remove(colocated)


async def _stream(base_url: str, prompt: list[int], max_tokens: int = 12) -> tuple[list[str], dict]:
    """A greedy streamed completion: its text deltas, and its usage."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    deltas, usage = [], None
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                deltas += [c["text"] for c in event["choices"] if c["text"]]
                usage = event.get("usage") or usage
    return deltas, usage


@pytest.mark.parametrize("length", [2 * BLOCK + 5, 3 * BLOCK])
def test_streams_equal_the_colocated_deployment_and_the_prompt_is_loaded_not_computed(apps, length):
    colocated, disaggregated = apps
    prompt = _prompt(length, length)
    expected, expected_usage = asyncio.run(_stream(colocated.base_url, prompt))
    got, usage = asyncio.run(_stream(disaggregated.base_url, prompt))
    assert "".join(got) == "".join(expected) and len(expected) > 0
    assert usage["prompt_tokens"] == expected_usage["prompt_tokens"] == length  # counted once
    assert usage["completion_tokens"] == expected_usage["completion_tokens"]
    # The decode replica never saw this prompt: its full blocks came from the prefill replica
    # through the cluster tier (the last token is computed again when the prompt fills its blocks).
    assert usage["prompt_tokens_details"]["cached_tokens"] == (length - 1) // BLOCK * BLOCK, usage


def test_status_shows_each_replica_s_role(apps, capsys):
    from raylm.deploy.cli import main

    assert main(["status", "--app", "pd"]) == 0
    out = capsys.readouterr().out
    table = out.split("Worker replicas\n")[1].split("\n\n")[0].splitlines()
    assert table[0].split()[:2] == ["replica", "role"], out
    assert sorted(row.split()[1] for row in table[2:]) == ["decode", "prefill"], out


async def _abandoned(base_url: str, prompt: list[int], after_s: float) -> None:
    """A streamed request whose client goes away after ``after_s``."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 0, "stream": True}
    async with httpx.AsyncClient(timeout=120) as client:
        try:
            await asyncio.wait_for(_read_all(client, f"{base_url}/v1/completions", body), after_s)
        except asyncio.TimeoutError:
            pass


async def _read_all(client: httpx.AsyncClient, url: str, body: dict) -> None:
    async with client.stream("POST", url, json=body) as response:
        async for _ in response.aiter_bytes():
            pass


def test_clients_gone_at_any_stage_leave_nothing_held_on_either_side(apps):
    _, disaggregated = apps

    async def abandon_many() -> None:
        await asyncio.gather(*(_abandoned(disaggregated.base_url, _prompt(100 + i, 200), after_s)
                               for i, after_s in enumerate([0.01, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6])))

    asyncio.run(abandon_many())
    held = wait_back_to_baseline("pd")
    assert held["worker_replicas"] == 2 and held["router_replicas"] == 1, held
    assert not any(v for k, v in held.items() if not k.endswith("_replicas")), f"still held: {held}"
    # and the application still serves
    got, _ = asyncio.run(_stream(disaggregated.base_url, _prompt(7, 40), max_tokens=4))
    assert got


def _router_metric(port: int, name: str) -> float:
    """The sum of a router metric's series for this module's model, as Ray's endpoint serves it now."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(rf'^{name}{{[^}}]*model_name="{MODEL}"[^}}]*}} (\S+)$', text,
                                                         re.MULTILINE))


def test_the_router_times_each_prefill_hop(apps, serve_cluster):
    _, disaggregated = apps
    count = "ray_raylm_router_pd_prefill_seconds_count"
    time.sleep(2.5)  # what earlier tests recorded has been exported (every 1 s here)
    before = _router_metric(serve_cluster.metrics_port, count)
    for seed in range(3):
        assert asyncio.run(_stream(disaggregated.base_url, _prompt(300 + seed, 40), max_tokens=2))[0]
    deadline = time.monotonic() + 30
    while _router_metric(serve_cluster.metrics_port, count) < before + 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _router_metric(serve_cluster.metrics_port, count) == before + 3
    assert _router_metric(serve_cluster.metrics_port, "ray_raylm_router_pd_fallbacks_total") == 0


def test_a_killed_prefill_replica_costs_at_most_a_recompute_not_the_request(apps, serve_cluster):
    """(Last: the prefill replica is replaced in the background.)"""
    colocated, disaggregated = apps
    fallbacks = "ray_raylm_router_pd_fallbacks_total"
    time.sleep(2.5)  # earlier fallbacks (none expected) have been exported
    before = _router_metric(serve_cluster.metrics_port, fallbacks)
    prompt = _prompt(500, 2 * BLOCK + 8)
    expected, _ = asyncio.run(_stream(colocated.base_url, prompt))
    kill_replica("pd", PREFILL_WORKER_DEPLOYMENT)
    # The router's prefill call fails (the replica is dead) or waits for its replacement: past
    # prefill_workers.timeout_s the decode replica computes the prompt, within it the replacement
    # prefills it. Either way the same tokens, and the accounting says which way it went.
    got, usage = asyncio.run(_stream(disaggregated.base_url, prompt))
    assert "".join(got) == "".join(expected)
    deadline = time.monotonic() + 5  # the router exports every second
    while _router_metric(serve_cluster.metrics_port, fallbacks) == before and time.monotonic() < deadline:
        time.sleep(0.5)
    fell_back = _router_metric(serve_cluster.metrics_port, fallbacks) - before
    assert fell_back in (0, 1)
    loaded = usage["prompt_tokens_details"]["cached_tokens"]
    assert loaded == (0 if fell_back else 2 * BLOCK), (fell_back, usage)  # computed there, or loaded
