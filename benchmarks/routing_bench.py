"""Prefix-aware routing vs Serve's power-of-two routing, side by side in one script.

Starts a local Ray cluster, deploys the bundled model on two worker replicas twice (router
``prefix_routing.enabled`` true, then false), runs the same ``raylm bench`` workloads against
each and reads every replica's prefix-cache counters before and after, so the hit rate is
the workers' own (prompt blocks found cached / prompt blocks looked up).

``multi-prefix`` (8 distinct 512-token prefixes, each used 12 times) is where routing
matters: each replica's KV pool (``--kv-blocks``) holds about half of the prefixes, so a
router that spreads every prefix over both replicas makes them evict each other's prefixes;
``shared-prefix`` (one prefix) is the easy case both handle: after one miss each, both
replicas hold it.

    python -m raylm.benchmarks.routing_bench [--workloads multi-prefix shared-prefix]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from typing import Any

from raylm.benchmarks.http_bench import WORKLOADS, Workload, run_workload
from raylm.benchmarks.local_serve import local_serve
from raylm.benchmarks.prometheus_scrape import counter_by_label
from raylm.deploy.config import PrefixRoutingSection

DECISIONS = "ray_raylm_router_routing_decisions_total"


def _snapshot(app: str) -> tuple[dict[str, int], dict[str, int]]:
    """Prefix-cache and request totals over the replicas, and requests per replica: one read."""
    from raylm.workers.wire.replica_protocol import replica_reports

    reports = replica_reports(app)
    totals = {"prefix_queries": sum(r.engine.pool.prefix_queries for r in reports.values()),
              "prefix_hits": sum(r.engine.pool.prefix_hits for r in reports.values())}
    return totals, {rid: r.engine.requests for rid, r in reports.items()}


def _decisions(metrics_port: int) -> dict[str, float]:
    """The prefix-aware router's replica choices so far, by reason (read after a 3 s settle:
    processes report metrics every second)."""
    time.sleep(3)
    return counter_by_label(metrics_port, DECISIONS, "reason")


ROUTINGS = {"prefix-aware": True, "power-of-two": False}


def run(workloads: list[Workload], kv_blocks: int, base_url: str, metrics_port: int,
        imbalance_threshold_tokens: int, routings: list[str]) -> list[dict[str, Any]]:
    from ray import serve

    from raylm.deploy.app_builder import build_application
    from raylm.deploy.config import parse_deploy_config

    rows = []
    for routing in routings:
        enabled = ROUTINGS[routing]
        name = "route-prefix" if enabled else "route-pow2"
        config = parse_deploy_config({
            "name": name,
            "workers": {"num_replicas": 2, "num_cpus": 1},
            "engine": {"num_kv_blocks": kv_blocks, "max_num_seqs": 16, "max_num_batched_tokens": 512,
                       "num_scheduler_steps": 4, "compilation_cache_dir": "~/.cache/raylm/jax"},
            "router": {"prefix_routing": {"enabled": enabled, "stats_period_s": 1.0,
                                          "imbalance_threshold_tokens": imbalance_threshold_tokens}},
        })
        serve.run(build_application(config), name=name, route_prefix=f"/{name}", blocking=False)
        base = f"{base_url}/{name}"
        for workload in workloads:
            before, before_replicas = _snapshot(name)
            decisions_before = _decisions(metrics_port) if enabled else {}
            result = asyncio.run(run_workload(base, config.served_model_name, workload, warmup=2))
            after, after_replicas = _snapshot(name)
            decisions = {reason: int(count - decisions_before.get(reason, 0))
                         for reason, count in (_decisions(metrics_port) if enabled else {}).items()}
            queries = after["prefix_queries"] - before["prefix_queries"]
            hits = after["prefix_hits"] - before["prefix_hits"]
            rows.append({
                "routing": routing,
                "workload": workload.name,
                "hit_rate": hits / queries if queries else 0.0,
                "output_tok_s": result.output_tok_s,
                "ttft_ms_p50": 1000 * sorted(result.ttft_s)[len(result.ttft_s) // 2] if result.ttft_s else None,
                "requests_per_replica": sorted(after_replicas[r] - before_replicas.get(r, 0) for r in after_replicas),
                "decisions": {reason: n for reason, n in sorted(decisions.items()) if n},
                "errors": result.errors,
            })
            print(json.dumps(rows[-1]), flush=True)
        serve.delete(name)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["multi-prefix", "shared-prefix"], choices=list(WORKLOADS))
    parser.add_argument("--kv-blocks", type=int, default=192, help="KV pool per replica (blocks of 16 tokens)")
    parser.add_argument("--imbalance-threshold", type=int, default=PrefixRoutingSection().imbalance_threshold_tokens,
                        help="router.prefix_routing.imbalance_threshold_tokens (default: the schema default)")
    parser.add_argument("--routing", nargs="+", default=list(ROUTINGS), choices=list(ROUTINGS))
    parser.add_argument("--requests", type=int, help="override the workloads' request count")
    parser.add_argument("--prefixes", type=int, help="override the workloads' number of distinct prefixes")
    parser.add_argument("--port", type=int, default=8010)
    parser.add_argument("--metrics-port", type=int, default=8011, help="Ray's metrics endpoint (routing decisions)")
    args = parser.parse_args(argv)
    overrides = {key: value for key, value in (("num_requests", args.requests), ("prefix_groups", args.prefixes))
                 if value is not None}
    workloads = [dataclasses.replace(WORKLOADS[name], **overrides) for name in args.workloads]
    with local_serve(args.port, metrics_port=args.metrics_port) as base_url:
        rows = run(workloads, args.kv_blocks, base_url, args.metrics_port, args.imbalance_threshold, args.routing)
    print(f"\n{'workload':<14} {'routing':<13} {'hit rate':>9} {'output tok/s':>13} {'TTFT p50 ms':>12}  "
          "requests/replica  decisions")
    for row in rows:
        ttft = f"{row['ttft_ms_p50']:.0f}" if row["ttft_ms_p50"] is not None else "-"
        decisions = ", ".join(f"{reason} {n}" for reason, n in row["decisions"].items()) or "-"
        print(f"{row['workload']:<14} {row['routing']:<13} {row['hit_rate']:>9.1%} {row['output_tok_s']:>13.1f} "
              f"{ttft:>12}  {str(row['requests_per_replica']):<16}  {decisions}")
    for workload in args.workloads:
        pair = {r["routing"]: r for r in rows if r["workload"] == workload}
        if len(pair) < 2:
            continue
        a, b = pair["prefix-aware"], pair["power-of-two"]
        hit_ratio = a["hit_rate"] / b["hit_rate"] if b["hit_rate"] else float("inf")
        print(f"{workload}: hit rate {hit_ratio:.2f}x, throughput {a['output_tok_s'] / b['output_tok_s']:.2f}x "
              "(prefix-aware / power-of-two)")


if __name__ == "__main__":
    main()
