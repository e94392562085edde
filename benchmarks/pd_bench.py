"""Prefill/decode disaggregation against colocated replicas: the decode latency of running streams
while long prompts arrive (issue 67's target: decode TPOT p99 with one prefill + one decode replica
at most 0.5x that of two colocated replicas on the same cores).

Starts a private local Ray cluster with Serve and deploys the model twice, one after the other,
on the same cores:

- ``colocated``: two worker replicas (``num_cpus: 1`` each, role both);
- ``disaggregated``: one prefill replica and one decode replica (``num_cpus: 1`` each), the
  prompts' KV handed over through the cluster tier (``engine.kv_offload.cluster_bytes``).

Both take the deploy file's engine settings (``deploy/default.yaml``) but one decode step per
engine call, so each streamed chunk is one token with its own arrival time. Each replica gets one
core: the cluster starts with ``NPROC=1`` (XLA's intra-op pool of one thread) and each worker
replica process is pinned to a core of its own once started (``core_pinning.py``). The workload
(``pd_traffic.py``): 16 streams of short prompts decoding throughout, and a distinct
2,000-token prompt every 2 s for the window; reported per deployment: decode TPOT p50/p99 of the
streams, the long prompts' TTFT and cached tokens, and the ratios disaggregated / colocated.

    python -m raylm.benchmarks.pd_bench [--duration 40] [--streams 16] [--long-prompt 2000]
    python -m raylm.benchmarks.pd_bench --smoke --model TINY_HF_DIR   # seconds: checks it runs
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import time
from importlib import resources
from typing import Any

import httpx
import yaml

from raylm.benchmarks.core_pinning import XLA_POOL_ENV, pin_replicas
from raylm.benchmarks.local_serve import local_serve
from raylm.benchmarks.pd_traffic import PDWorkload, run_traffic
from raylm.benchmarks.replica_counters import sum_replicas, wait_until_warm
from raylm.benchmarks.step_rates import format_step_rates, step_rates
from raylm.workers.core.engine_stats import ComputeStats

DEPLOYMENTS = ("colocated", "disaggregated")
# The full run's KV pool: 16 streams of up to 2,080 tokens and the long prompts fit one replica's.
FULL_ENGINE = {"kv_cache_memory_bytes": 2 << 30}
# A smoke run's workload and engine: a tiny model (vocabulary 320, 1024 positions or more) and
# seconds of traffic.
SMOKE = PDWorkload(streams=4, stream_prompt_tokens=8, stream_max_tokens=1000, long_prompt_tokens=48,
                   long_output_tokens=4, interval_s=0.5, duration_s=2.0, settle_s=0.5, token_range=(3, 300))
SMOKE_ENGINE = {"block_size": 16, "num_kv_blocks": 384, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                "max_model_len": 1024}


def deploy_configs(model: str | None, engine: dict[str, Any], cluster_bytes: int) -> dict[str, dict[str, Any]]:
    """Raw deploy configs of both deployments: ``deploy/default.yaml`` with ``engine`` over its
    engine section, one decode step per call, and the worker groups each comparison needs."""
    base = yaml.safe_load(resources.files("raylm.deploy").joinpath("default.yaml").read_text())
    for key in ("http", "route_prefix"):
        base.pop(key, None)
    if model is not None:
        base["model"] = {"name": model, "served_model_name": "pd-bench"}
    base["engine"] = {**base["engine"], **engine, "num_scheduler_steps": 1}
    one = {"num_replicas": 1, "num_cpus": 1}
    return {
        "colocated": {**base, "name": "pd-colocated", "workers": {**base["workers"], "num_replicas": 2, "num_cpus": 1}},
        "disaggregated": {**base, "name": "pd-disaggregated", "workers": {**base["workers"], **one},
                          "prefill_workers": one,
                          "engine": {**base["engine"], "kv_offload": {"cluster_bytes": cluster_bytes}}},
    }


def _programs_left(app: str, replicas: int):
    """The replicas' warm-up programs left, None until all ``replicas`` of ``app`` answer."""
    from raylm.workers.wire.replica_protocol import replica_reports

    def left() -> int | None:
        reports = replica_reports(app)
        return sum(r.engine.warmup_programs_left for r in reports.values()) if len(reports) == replicas else None

    return left


def _wait_serving(base: str, model: str, token: int, timeout_s: float) -> None:
    """Until one short completion through ``base`` succeeds (the router and both hops up)."""
    deadline = time.monotonic() + timeout_s
    body = {"model": model, "prompt": [token] * 3, "max_tokens": 2, "temperature": 0}
    while True:
        try:
            if httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base} did not serve a completion within {timeout_s:.0f} s")
        time.sleep(1.0)


def _requests_per_replica(app: str) -> dict[str, int]:
    from raylm.workers.wire.replica_protocol import replica_reports

    return {rid: report.engine.requests for rid, report in replica_reports(app).items()}


def _compute(app: str) -> ComputeStats | None:
    """The replicas' step counters, summed per step kind (``step_rates.py``)."""
    from raylm.workers.wire.replica_protocol import replica_reports

    return sum_replicas([report.engine for report in replica_reports(app).values()]).compute


def measure(serve_url: str, raw_config: dict[str, Any], workload: PDWorkload, *, pin: bool,
            warmup_timeout_s: float = 900.0) -> dict[str, Any]:
    """Deploy ``raw_config`` on the Serve instance at ``serve_url``, wait for its warm-up, pin its
    worker replicas to a core each (``pin``), run the traffic once, delete it; the figures."""
    from ray import serve

    from raylm.deploy.app_builder import build_application
    from raylm.deploy.config import parse_deploy_config

    config = parse_deploy_config({**raw_config, "route_prefix": f"/{raw_config['name']}"})
    replicas = (config.workers.num_replicas or 1) + (
        config.prefill_workers.num_replicas or 1 if config.prefill_workers is not None else 0)
    serve.run(build_application(config), name=config.name, route_prefix=f"/{config.name}", blocking=False)
    base = f"{serve_url}/{config.name}"
    try:
        wait_until_warm(_programs_left(config.name, replicas), warmup_timeout_s)
        _wait_serving(base, config.served_model_name, workload.token_range[0], warmup_timeout_s)
        pinned = pin_replicas(config.name, replicas) if pin else []
        before, compute_before = _requests_per_replica(config.name), _compute(config.name)
        streaming: dict[str, int] = {}
        result = asyncio.run(run_traffic(base, config.served_model_name, workload,
                                         lambda: streaming.update(_requests_per_replica(config.name))))
        after, compute_after = _requests_per_replica(config.name), _compute(config.name)
    finally:
        serve.delete(config.name)
    # Streams per replica: what each had been sent when every stream had its first token (in the
    # disaggregated deployment the prefill replica counts each stream's prefill hop too).
    result["streams_per_replica"] = sorted(streaming[r] - before.get(r, 0) for r in streaming)
    result["requests_per_replica"] = sorted(after[r] - before.get(r, 0) for r in after)
    # Per step kind over the whole run (streams' start to the last long prompt's end): how many
    # prompt tokens per second the replicas computed, against the 1,000 a second the workload sends.
    result["step_rates"] = step_rates(compute_before, compute_after, None)
    result["pinned"] = [f"{p.deployment} pid {p.pid} -> core {p.core} ({p.threads} threads, "
                        f"{p.xla_pool_threads} XLA pool)" for p in pinned]
    return result


def ratios(colocated: dict[str, Any], disaggregated: dict[str, Any]) -> dict[str, float | None]:
    """Disaggregated / colocated for each latency figure (None where either is missing)."""
    keys = ("tpot_ms_p50", "tpot_ms_p99", "long_ttft_ms_p50", "long_ttft_ms_p99")
    return {key: disaggregated[key] / colocated[key] if disaggregated[key] and colocated[key] else None
            for key in keys}


def _cell(value: Any, fmt: str = "{:.1f}") -> str:
    if isinstance(value, int) and fmt == "{:.1f}":
        fmt = "{:d}"
    return "-" if value is None else fmt.format(value)


def format_report(rows: dict[str, dict[str, Any]], workload: PDWorkload) -> str:
    """The two deployments side by side and the ratios B/A."""
    lines = [f"== {workload.streams} decode streams ({workload.stream_prompt_tokens}-token prompts) + a "
             f"{workload.long_prompt_tokens}-token prompt every {workload.interval_s:g} s for "
             f"{workload.duration_s:g} s ==",
             f"  {'':<28}{'A colocated':>14}{'B disaggregated':>17}{'B/A':>8}"]
    ratio = ratios(rows["colocated"], rows["disaggregated"]) if len(rows) == 2 else {}
    labels = (("decode TPOT p50 (ms)", "tpot_ms_p50"), ("decode TPOT p99 (ms)", "tpot_ms_p99"),
              ("decode TPOT max (ms)", "tpot_ms_max"), ("decode tokens/s", "decode_tok_s"),
              ("long prompt TTFT p50 (ms)", "long_ttft_ms_p50"), ("long prompt TTFT p99 (ms)", "long_ttft_ms_p99"),
              ("long prompts sent", "long_prompts_sent"), ("long prompts completed", "long_prompts_completed"),
              ("long prompt cached tokens", "long_cached_tokens_mean"), ("streams ended early", "streams_ended_early"))
    for label, key in labels:
        cells = [_cell(rows.get(name, {}).get(key)) for name in DEPLOYMENTS]
        lines.append(f"  {label:<28}{cells[0]:>14}{cells[1]:>17}{_cell(ratio.get(key), '{:.2f}x'):>8}")
    for name, row in rows.items():
        lines.append(f"  {name}: streams per replica {row['streams_per_replica']}, requests per replica "
                     f"{row['requests_per_replica']}, pinned: {', '.join(row['pinned']) or 'no'}")
        lines += [f"  {name} error: {e}" for e in row["stream_errors"] + row["long_prompt_errors"]]
        if row["step_rates"] is not None:
            lines += format_step_rates(name, row["step_rates"], None)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="registry name, GGUF or HF directory (default: the deploy "
                                                      "file's, the bundled model)")
    parser.add_argument("--smoke", action="store_true", help="seconds of traffic sized for a tiny model (--model)")
    parser.add_argument("--streams", type=int, help="decode streams (default 16)")
    parser.add_argument("--long-prompt", type=int, help="tokens of each long prompt (default 2000)")
    parser.add_argument("--interval", type=float, help="seconds between long prompts (default 2)")
    parser.add_argument("--duration", type=float, help="seconds of the measured window (default 40)")
    parser.add_argument("--stream-tokens", type=int, help="max_tokens of each stream (default 2048)")
    parser.add_argument("--cluster-bytes", type=int, default=2 << 30, help="the disaggregated cluster tier")
    parser.add_argument("--deployments", nargs="+", default=list(DEPLOYMENTS), choices=DEPLOYMENTS)
    parser.add_argument("--no-pin", action="store_true", help="leave the replicas' threads where the OS puts them")
    parser.add_argument("--port", type=int, default=8016)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return parser


def run(serve_url: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Both deployments, one after the other, on the Serve instance at ``serve_url`` (of the Ray
    cluster this process is connected to); prints each one's figures and the report."""
    overrides = {key: value for key, value in (
        ("streams", args.streams), ("long_prompt_tokens", args.long_prompt), ("interval_s", args.interval),
        ("duration_s", args.duration), ("stream_max_tokens", args.stream_tokens)) if value is not None}
    workload = dataclasses.replace(SMOKE if args.smoke else PDWorkload(), **overrides)
    configs = deploy_configs(args.model, SMOKE_ENGINE if args.smoke else FULL_ENGINE, args.cluster_bytes)
    rows = {}
    for name in args.deployments:
        rows[name] = measure(serve_url, configs[name], workload, pin=not args.no_pin)
        print(json.dumps({"deployment": name, **rows[name]}), flush=True)
    print(format_report(rows, workload), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": dataclasses.asdict(workload), "rows": rows,
                       "ratios": ratios(rows["colocated"], rows["disaggregated"]) if len(rows) == 2 else None},
                      f, indent=2)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    os.environ.update(XLA_POOL_ENV)  # inherited by the cluster's workers: one XLA thread per replica
    with local_serve(args.port) as serve_url:
        run(serve_url, args)


if __name__ == "__main__":
    main()
