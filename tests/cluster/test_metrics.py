"""Ray's metrics endpoint serves every raylm metric after real traffic, with the right counts;
tenant tags (without Ray) are ASCII, stable and bounded."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from raylm.cluster.metrics import MAX_TENANT_TAGS, ROUTER_METRICS, WORKER_METRICS, RouterMetrics, tenant_tag
from tests.serving import TEST_DEPLOY

MODEL = "metrics-model"


@pytest.fixture(scope="module")
def metrics_app(serve_cluster):
    app = serve_cluster.deploy({
        "name": "metrics", "model": {"served_model_name": MODEL}, "workers": {"num_replicas": 1},
        # A pool of 11 blocks (176 tokens) for 4 concurrent ~90-token requests: preemptions happen.
        # N-gram speculation (counting repeats itself) exports the spec_decode counters. A host
        # tier beyond the pool exports the KV offload metrics: blocks the small pool evicts come back
        # from it.
        "engine": {**TEST_DEPLOY["engine"], "num_kv_blocks": 12, "max_num_seqs": 4, "max_model_len": 160,
                   "num_scheduler_steps": 1, "speculative": {"method": "ngram", "num_speculative_tokens": 3},
                   "hidden_state_slots": 0,  # (hidden states do not combine with speculation)
                   "kv_offload": {"host_bytes": "64MiB"}},
        "router": {"prefix_routing": {"stats_period_s": 0.5}},
    }, route_prefix="/metrics-app")
    yield app
    serve_cluster.remove(app)


def _scrape(port: int) -> dict[str, float]:
    """Sum of each series name (with its labels) for our model, as Prometheus text gives it."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or f'model_name="{MODEL}"' not in line:
            continue
        match = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)", line)
        if match:
            name, labels, value = match.groups()
            values[name] = values.get(name, 0.0) + float(value)
            if "finished_reason" in (labels or "") or "reason" in (labels or ""):
                key = name + "{" + ",".join(sorted(re.findall(r'(?:finished_reason|reason|status)="([^"]*)"', labels))) + "}"
                values[key] = values.get(key, 0.0) + float(value)
    return values


def test_every_metric_is_exported_with_counts_matching_usage(metrics_app, serve_cluster, capsys):
    base = metrics_app.base_url
    def chat(i: int) -> dict:
        return {"model": MODEL, "messages": [{"role": "user", "content": f"Count from {i} to {i + 40}."}],
                "max_tokens": 64, "ignore_eos": True, "temperature": 0}

    async def traffic() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            responses = await asyncio.gather(*(client.post(f"{base}/v1/chat/completions", json=chat(i)) for i in range(4)))
            assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
            usages = [r.json()["usage"] for r in responses]
            stream = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "stream": True,
                      "stream_options": {"include_usage": True}}
            async with client.stream("POST", f"{base}/v1/completions", json=stream) as response:
                lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
            usages.append(__import__("json").loads(lines[-1][6:])["usage"])
            # A beam search request is one request with one success per beam.
            beams = await client.post(f"{base}/v1/completions", json={
                "model": MODEL, "prompt": "The weather today", "max_tokens": 4, "n": 2, "use_beam_search": True,
                "temperature": 0})
            assert beams.status_code == 200, beams.text
            usages.append(beams.json()["usage"])
            assert (await client.post(f"{base}/v1/completions", json={"model": "nope", "prompt": "x"})).status_code == 404
            assert (await client.post(f"{base}/v1/completions", json={"model": MODEL})).status_code == 400
            return usages

    usages = asyncio.run(traffic())
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    completion_tokens = sum(u["completion_tokens"] for u in usages)

    # Each Ray process exports its metrics on its own period: wait until the router's and the
    # worker's final counts have all arrived (or the deadline), then check them.
    # (the prefill hop's histogram is observed by disaggregated applications: tests/router/test_pd_serving.py)
    histograms = [n for n, (kind, _) in {**WORKER_METRICS, **ROUTER_METRICS}.items()
                  if kind == "histogram" and n != "raylm_router_pd_prefill_seconds"]
    expected = {
        "ray_raylm_generation_tokens_total": completion_tokens,
        "ray_raylm_prompt_tokens_total": prompt_tokens,
        "ray_raylm_time_to_first_token_seconds_count": 6,
        "ray_raylm_e2e_request_latency_seconds_count": 6,
        "ray_raylm_request_success_total": 7,
        "ray_raylm_router_routing_decisions_total": 6,
        "ray_raylm_router_requests_rejected_total": 2,
        "ray_raylm_router_tenant_tokens_total": prompt_tokens + completion_tokens,
        **_speculation_expected(),
        **_kv_offload_expected(),
    }
    deadline = time.monotonic() + 90
    while True:
        values = _scrape(serve_cluster.metrics_port)
        arrived = (all(values.get(name) == count for name, count in expected.items())
                   and all(values.get(f"ray_{name}_count", 0) >= 1 for name in histograms))
        if arrived or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert values.get("ray_raylm_generation_tokens_total") == completion_tokens, values
    assert values.get("ray_raylm_prompt_tokens_total") == prompt_tokens, values

    for name in histograms:
        assert values.get(f"ray_{name}_count", 0) >= 1, name
    for name in ("raylm_num_requests_running", "raylm_num_requests_waiting", "raylm_num_requests_loading",
                 "raylm_kv_cache_usage_perc", "raylm_router_queue_depth"):
        assert f"ray_{name}" in values, name
    assert values["ray_raylm_time_to_first_token_seconds_count"] == 6
    assert values["ray_raylm_e2e_request_latency_seconds_count"] == 6
    assert values["ray_raylm_request_success_total"] == 7
    assert values["ray_raylm_prefix_cache_hits_total"] > 0  # the four chats share their prompt
    assert values["ray_raylm_prefix_cache_queries_total"] >= values["ray_raylm_prefix_cache_hits_total"]
    assert values["ray_raylm_num_preemptions_total"] > 0
    assert values["ray_raylm_router_routing_decisions_total"] == 6
    assert values["ray_raylm_router_requests_rejected_total"] == 2
    assert values["ray_raylm_router_tenant_tokens_total"] == prompt_tokens + completion_tokens
    _check_speculation(values, expected)
    assert values["ray_raylm_kv_offload_hits_total"] > 0  # preempted requests' blocks came back from the host tier
    for name in ("ray_raylm_kv_offload_hits_total", "ray_raylm_kv_offload_stored_total",
                 "ray_raylm_kv_offload_load_bytes_total", "ray_raylm_kv_offload_capacity_bytes"):
        assert values.get(name) == expected[name], (name, values.get(name), expected[name])

    from raylm.deploy.cli import main

    capsys.readouterr()
    assert main(["status", "--app", "metrics"]) == 0
    assert re.search(r"host \d+\.\d/64\.0 MiB \d+% hits", capsys.readouterr().out)  # the replica's tier use


def _speculation_expected() -> dict[str, float]:
    """The worker's own speculative decoding counters after the traffic (what ``raylm bench
    --ray-app`` reads), as the exported series must come to show them."""
    from raylm.benchmarks.replica_counters import ReplicaCounters

    replicas = ReplicaCounters("metrics").totals()
    totals = replicas.spec
    assert totals is not None, "the metrics app speculates: its replica must report spec counters"
    verify = replicas.compute.kinds["verify"]  # the step counters cross Ray too
    assert verify.steps > 0 and verify.flops > 0 and verify.seconds > 0
    return {
        "ray_raylm_spec_decode_num_drafts_total": totals.num_drafts,
        "ray_raylm_spec_decode_num_draft_tokens_total": totals.num_draft_tokens,
        "ray_raylm_spec_decode_num_accepted_tokens_total": totals.num_accepted_tokens,
        "ray_raylm_spec_decode_num_accepted_tokens_per_pos_total": totals.num_accepted_tokens,
    }


def _kv_offload_expected() -> dict[str, float]:
    """The replica's own host tier counters after the traffic, as the exported series must show them."""
    from raylm.workers.wire.replica_protocol import replica_reports

    (report,) = replica_reports("metrics").values()
    (host,) = report.engine.kv_offload
    assert host.tier == "host" and host.capacity_bytes == 64 << 20
    return {
        "ray_raylm_kv_offload_hits_total": host.hits,
        "ray_raylm_kv_offload_stored_total": host.stored,
        "ray_raylm_kv_offload_load_bytes_total": host.load_bytes,
        "ray_raylm_kv_offload_capacity_bytes": host.capacity_bytes,
    }


def _check_speculation(values: dict[str, float], expected: dict[str, float]) -> None:
    guessed = values["ray_raylm_spec_decode_num_draft_tokens_total"]
    accepted = values["ray_raylm_spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= guessed, values
    assert 0 < values["ray_raylm_spec_decode_num_drafts_total"] <= guessed
    for name, count in expected.items():
        if "spec_decode" in name:
            assert values.get(name) == count, (name, values.get(name), count)


def test_tenant_tags_are_ascii_stable_and_bounded():
    assert tenant_tag("team-a") == "team-a"
    for hostile in ["josé", "😀", "a b", chr(0xD800), "x" * 65, ""]:
        tag = tenant_tag(hostile)
        assert tag.isascii() and tag.startswith("h-") and tag == tenant_tag(hostile)
    assert tenant_tag("josé") != tenant_tag("josé")
    metrics = RouterMetrics("m")
    tags = {metrics._tenant_tag(f"t{i}") for i in range(MAX_TENANT_TAGS + 50)}
    assert len(tags) == MAX_TENANT_TAGS + 1 and "other" in tags
