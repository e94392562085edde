"""Adapter-affinity routing against Serve's power-of-two routing: how often a LoRA request finds
its adapter already in a device slot of the replica it lands on.

Starts a local Ray cluster and deploys the bundled model on two worker replicas with
``--adapters`` random adapters (``lora_bench.write_random_adapter``) and ``max_loras`` slots
each (by default half of the adapters: both replicas together hold them all), twice: router
``prefix_routing.enabled`` true (adapter affinity), then false (Serve's default router). The
same requests, each for a random adapter with a prompt of its own (so no prefix cache hit steers
the choice), run ``--concurrency`` at a time. The hit rate is the replicas' own count: requests
whose adapter was resident = requests - slot loads.

    python -m raylm.benchmarks.lora_affinity_bench [--adapters 8] [--requests 96] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from raylm.benchmarks.local_serve import local_serve
from raylm.benchmarks.lora_bench import write_random_adapter

ROUTINGS = {"adapter-affinity": True, "power-of-two": False}


def _loads(app: str) -> int:
    """Slot fills over every replica of ``app`` so far."""
    from raylm.workers.wire.replica_protocol import replica_reports

    return sum(sum(r.engine.lora.loads.values()) for r in replica_reports(app).values())


async def _traffic(base: str, models: list[str], prompts: list[list[int]], concurrency: int, new_tokens: int) -> int:
    """Every request, ``concurrency`` at a time; returns how many failed."""
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, model: str, prompt: list[int]) -> bool:
        async with gate:
            response = await client.post(f"{base}/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True})
            return response.status_code == 200

    async with httpx.AsyncClient(timeout=600) as client:
        done = await asyncio.gather(*(one(client, m, p) for m, p in zip(models, prompts)))
    return done.count(False)


def run(args: argparse.Namespace, base_url: str, adapters: dict[str, str]) -> list[dict[str, Any]]:
    from ray import serve

    from raylm.deploy.app_builder import build_application
    from raylm.deploy.config import parse_deploy_config

    rng = np.random.RandomState(0)
    names = list(adapters)
    models = [names[i] for i in rng.randint(0, len(names), args.requests)]
    prompts = [rng.randint(1000, 20000, args.prompt).tolist() for _ in range(args.requests + 2 * len(names))]
    rows = []
    for routing, enabled in ROUTINGS.items():
        name = f"lora-{routing}"
        config = parse_deploy_config({
            "name": name,
            "model": {"lora_modules": [{"name": n, "path": p} for n, p in adapters.items()]},
            "workers": {"num_replicas": 2, "num_cpus": 1},
            "engine": {"max_loras": args.max_loras or len(names) // 2, "max_lora_rank": args.rank,
                       "num_kv_blocks": 256, "max_num_seqs": 8, "max_model_len": 512,
                       "compilation_cache_dir": "~/.cache/raylm/jax"},
            "router": {"prefix_routing": {"enabled": enabled, "stats_period_s": 0.5}},
        })
        serve.run(build_application(config), name=name, route_prefix=f"/{name}", blocking=False)
        base = f"{base_url}/{name}"
        warm = asyncio.run(_traffic(base, names * 2, prompts[args.requests:], args.concurrency, 2))  # compile
        before = _loads(name)
        errors = asyncio.run(_traffic(base, models, prompts[: args.requests], args.concurrency, args.new_tokens))
        loads = _loads(name) - before
        rows.append({"routing": routing, "requests": args.requests, "slot_loads": loads,
                     "hit_rate": 1 - loads / args.requests, "errors": errors + warm})
        print(json.dumps(rows[-1]), flush=True)
        serve.delete(name)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--max-loras", type=int, help="slots per replica (default: half the adapters)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--port", type=int, default=8012)
    args = parser.parse_args(argv)

    from raylm.model.config.model_info import load_model_info
    from raylm.model.config.registry import DEFAULT_MODEL

    config = load_model_info(DEFAULT_MODEL).config
    with tempfile.TemporaryDirectory() as root:
        adapters = {f"a{i}": str(write_random_adapter(Path(root) / f"a{i}", config, args.rank, i))
                    for i in range(args.adapters)}
        with local_serve(args.port) as base_url:
            rows = run(args, base_url, adapters)
    by = {row["routing"]: row for row in rows}
    affinity, pow2 = by["adapter-affinity"]["hit_rate"], by["power-of-two"]["hit_rate"]
    print(f"hit rate: adapter-affinity {affinity:.1%}, power-of-two {pow2:.1%} = "
          f"{affinity / pow2 if pow2 else float('inf'):.2f}x")


if __name__ == "__main__":
    main()
