"""The KV offload tiers' metrics as Ray's metrics endpoint serves them: one series per tier (and
per error kind), counts equal to the TierStats snapshots a replica's reporter was handed, the
load-time histogram with one observation per read. The reporter runs in a Ray actor as it does
in a worker replica; the snapshots are built here, so the expected values are known exactly."""

from __future__ import annotations

import re
import time

import httpx
import ray

from raylm.cache.block_pool import PoolStats
from raylm.cache.offload.tier import TierStats
from raylm.workers.core.engine_stats import EngineStats

MODEL = "kv-offload-metrics-model"
POOL = PoolStats(num_free_blocks=8, num_used_blocks=0, num_cached_blocks=0, num_usable_blocks=8, usage=0.0,
                 prefix_queries=0, prefix_hits=0)


@ray.remote(num_cpus=0)
class _Replica:
    """A worker replica's metrics path without its engine: WorkerMetrics fed by EngineStatsReporter."""

    def __init__(self) -> None:
        from raylm.cluster.metrics import WorkerMetrics
        from raylm.workers.serve.replica_metrics import EngineStatsReporter

        self.reporter = EngineStatsReporter(WorkerMetrics(MODEL, "replica-1"))

    def report(self, stats: dict) -> None:
        self.reporter.report(EngineStats.from_dict(stats))


def _stats(tiers: tuple[TierStats, ...], loading: int) -> dict:
    return EngineStats(running=0, waiting=0, waiting_tokens=0, work_tokens=0, tokens_stored=0, token_capacity=0,
                       num_preemptions=0, requests=0, prompt_tokens=0, generation_tokens=0, pool=POOL,
                       loading=loading, kv_offload=tiers).as_dict()


def _scrape(port: int) -> dict[str, float]:
    """Our model's series, keyed ``name{tier,kind,le}`` (the labels that tell them apart here)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or f'model_name="{MODEL}"' not in line:
            continue
        match = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)", line)
        if match:
            name, labels, value = match.groups()
            found = dict(re.findall(r'\b(tier|kind|le)="([^"]*)"', labels or ""))
            keep = ",".join(f"{key}={found[key]}" for key in ("tier", "kind", "le") if key in found)
            values[f"{name}{{{keep}}}"] = float(value)
    return values


def test_tier_metrics_reach_prometheus_per_tier_and_kind(serve_cluster):
    replica = _Replica.remote()
    host = TierStats("host", 4 << 30, stored_bytes=3 << 20, stored_blocks=3, hits=4, misses=1, stored=5, evicted=2,
                     load_bytes=4 << 20, loads=2, recent_load_seconds=[0.0002, 0.003])
    ray.get(replica.report.remote(_stats((host,), loading=2)))
    host = TierStats("host", 4 << 30, stored_bytes=5 << 20, stored_blocks=5, hits=9, misses=1, stored=8, evicted=3,
                     load_bytes=9 << 20, loads=3, recent_load_seconds=[0.0002, 0.003, 0.02])
    disk = TierStats("disk", 64 << 30, stored_bytes=1 << 20, stored_blocks=1, hits=0, misses=2, stored=1,
                     loads=1, recent_load_seconds=[0.5], errors={"corrupt": 2})
    ray.get(replica.report.remote(_stats((host, disk), loading=1)))

    expected = {
        "ray_raylm_kv_offload_hits_total{tier=host}": 9,
        "ray_raylm_kv_offload_misses_total{tier=host}": 1,
        "ray_raylm_kv_offload_misses_total{tier=disk}": 2,
        "ray_raylm_kv_offload_stored_total{tier=host}": 8,
        "ray_raylm_kv_offload_stored_total{tier=disk}": 1,
        "ray_raylm_kv_offload_evicted_total{tier=host}": 3,
        "ray_raylm_kv_offload_load_bytes_total{tier=host}": 9 << 20,
        "ray_raylm_kv_offload_errors_total{tier=disk,kind=corrupt}": 2,
        "ray_raylm_kv_offload_stored_bytes{tier=host}": 5 << 20,
        "ray_raylm_kv_offload_capacity_bytes{tier=disk}": 64 << 30,
        "ray_raylm_kv_offload_load_seconds_count{tier=host}": 3,
        "ray_raylm_kv_offload_load_seconds_count{tier=disk}": 1,
        "ray_raylm_kv_offload_load_seconds_bucket{tier=host,le=0.001}": 1,  # 0.2 ms; 3 ms and 20 ms above
        "ray_raylm_kv_offload_load_seconds_bucket{tier=disk,le=0.25}": 0,
        "ray_raylm_kv_offload_load_seconds_bucket{tier=disk,le=0.5}": 1,
        "ray_raylm_num_requests_loading{}": 1,
    }
    deadline = time.monotonic() + 60
    while True:
        values = _scrape(serve_cluster.metrics_port)
        if all(values.get(name) == value for name, value in expected.items()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert {name: values.get(name) for name in expected} == expected, sorted(values)
    ray.kill(replica)
