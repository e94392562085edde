"""Autoscaling under load: how long until a second worker replica serves, and is any request lost.

Deploys the deploy file (default ``deploy/default.yaml``) on a private local Ray cluster with
the worker deployment autoscaled between 1 and 2 replicas by the LLM policy, then:

1. scale up: ``--clients`` closed-loop clients send completions (``--prompt-tokens`` random
   token ids, ``--output-tokens`` greedy) until a second replica is RUNNING and has served a
   request, then keep going for ``--hold-s``;
2. scale down: all clients but one stop; that one keeps sending until Serve is back to one
   replica, so requests in flight on the draining replica are counted too.

It reports the time from load start to the second replica RUNNING (Serve's state) and to its
first served request, the time from the load drop back to one replica, and per phase the
requests sent, the non-200 answers (goal: none) and output tokens/s. The scale-up time is the
configured ``--upscale-delay-s`` plus the replica start (actor, model load, warm-up compile
from the persistent compilation cache the first replica filled).

    python -m raylm.benchmarks.autoscale_bench [--config deploy/default.yaml]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import random
import time

import httpx

from raylm.benchmarks.local_serve import local_serve
from raylm.cluster.names import WORKER_DEPLOYMENT
from raylm.deploy.config import DeployConfig, load_deploy_config, parse_deploy_config


@dataclasses.dataclass
class Answer:
    phase: str
    status: int
    output_tokens: int


@dataclasses.dataclass
class Timeline:
    """Seconds from the load start to each scale-up event, and from the load drop to one replica."""

    second_running_s: float | None = None
    second_serving_s: float | None = None
    back_to_one_s: float | None = None


def autoscaled(config: DeployConfig, args: argparse.Namespace) -> DeployConfig:
    """The deploy file with its workers autoscaled 1..2 by the LLM policy and a small batch."""
    raw = config.model_dump(mode="json", exclude_none=True)
    raw["workers"].pop("num_replicas", None)
    raw["workers"]["autoscaling_config"] = {
        "min_replicas": 1, "max_replicas": 2, "policy": "llm", "target_batch_utilization": 0.5,
        "metrics_interval_s": 0.5, "look_back_period_s": 2,
        "upscale_delay_s": args.upscale_delay_s, "downscale_delay_s": args.downscale_delay_s,
    }
    raw["engine"]["max_num_seqs"] = args.max_num_seqs
    raw["route_prefix"] = "/"
    return parse_deploy_config(raw)


def served_requests(app: str) -> dict[str, int]:
    from raylm.workers.wire.replica_protocol import replica_reports

    return {replica: report.engine.requests for replica, report in replica_reports(app).items()}


class LoadGenerator:
    """Closed-loop clients, each sending the next request when its last one is answered."""

    def __init__(self, base_url: str, model: str, args: argparse.Namespace):
        self.url = f"{base_url}/v1/completions"
        self.model = model
        self.args = args
        self.phase = "scale-up"
        self.answers: list[Answer] = []
        self.active_clients = args.clients
        self.stopped = asyncio.Event()
        self.rng = random.Random(0)

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            await asyncio.gather(*(self._client(client, i) for i in range(self.args.clients)))

    async def _client(self, client: httpx.AsyncClient, index: int) -> None:
        while not self.stopped.is_set() and index < self.active_clients:
            body = {"model": self.model, "max_tokens": self.args.output_tokens, "ignore_eos": True,
                    "temperature": 0, "prompt": [self.rng.randrange(100, 40000) for _ in range(self.args.prompt_tokens)]}
            phase = self.phase
            try:
                response = await client.post(self.url, json=body)
                tokens = response.json().get("usage", {}).get("completion_tokens", 0) if response.status_code == 200 else 0
                self.answers.append(Answer(phase, response.status_code, tokens))
            except httpx.HTTPError:
                self.answers.append(Answer(phase, 0, 0))  # connection-level failure: lost


async def scenario(app: str, base_url: str, model: str, args: argparse.Namespace) -> tuple[Timeline, dict[str, float]]:
    from raylm.cluster.replicas import running_replicas

    load = LoadGenerator(base_url, model, args)
    timeline = Timeline()
    phase_seconds: dict[str, float] = {}
    first = set(await asyncio.to_thread(served_requests, app))
    started = time.monotonic()
    task = asyncio.create_task(load.run())
    try:
        while timeline.second_serving_s is None:
            running = await asyncio.to_thread(running_replicas, app, WORKER_DEPLOYMENT)
            if running >= 2 and timeline.second_running_s is None:
                timeline.second_running_s = time.monotonic() - started
            served = await asyncio.to_thread(served_requests, app)
            if any(replica not in first and count > 0 for replica, count in served.items()):
                timeline.second_serving_s = time.monotonic() - started
            if time.monotonic() - started > args.timeout_s:
                raise TimeoutError(f"no second serving replica within {args.timeout_s} s")
            await asyncio.sleep(0.5)
        phase_seconds["scale-up"] = time.monotonic() - started
        load.phase = "hold"
        await asyncio.sleep(args.hold_s)
        phase_seconds["hold"] = args.hold_s
        load.phase, load.active_clients = "scale-down", 1
        dropped = time.monotonic()
        while await asyncio.to_thread(running_replicas, app, WORKER_DEPLOYMENT) > 1:
            if time.monotonic() - dropped > args.timeout_s:
                raise TimeoutError(f"not back to one replica within {args.timeout_s} s")
            await asyncio.sleep(0.5)
        timeline.back_to_one_s = phase_seconds["scale-down"] = time.monotonic() - dropped
    finally:
        load.stopped.set()
        await task
    return timeline, _phase_report(load.answers, phase_seconds)


def _phase_report(answers: list[Answer], phase_seconds: dict[str, float]) -> dict[str, dict[str, float]]:
    report: dict[str, dict[str, float]] = {}
    by_phase: dict[str, list[Answer]] = collections.defaultdict(list)
    for answer in answers:
        by_phase[answer.phase].append(answer)
    for phase, seconds in phase_seconds.items():
        rows = by_phase[phase]
        report[phase] = {
            "seconds": seconds,
            "requests": len(rows),
            "non_200": sum(a.status != 200 for a in rows),
            "output_tok_s": sum(a.output_tokens for a in rows) / seconds if seconds else 0.0,
        }
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deploy/default.yaml")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=4, help="batch size per replica (small: saturates fast)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--upscale-delay-s", type=float, default=5.0)
    parser.add_argument("--downscale-delay-s", type=float, default=10.0)
    parser.add_argument("--hold-s", type=float, default=20.0, help="load kept on two replicas before the drop")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--port", type=int, default=8012)
    args = parser.parse_args(argv)
    config = autoscaled(load_deploy_config(args.config), args)

    from ray import serve

    from raylm.deploy.app_builder import build_application

    with local_serve(args.port) as base_url:
        serve.run(build_application(config), name=config.name, route_prefix="/")  # returns once RUNNING
        timeline, phases = asyncio.run(scenario(config.name, base_url, config.served_model_name, args))
    print(f"\nautoscaling 1..2 replicas, policy llm, upscale delay {args.upscale_delay_s:g} s, "
          f"downscale delay {args.downscale_delay_s:g} s, {args.clients} clients, max_num_seqs {args.max_num_seqs}")
    print(f"load start -> second replica RUNNING: {timeline.second_running_s:.1f} s; "
          f"-> serving: {timeline.second_serving_s:.1f} s")
    print(f"load drop (to 1 client) -> one replica: {timeline.back_to_one_s:.1f} s")
    print(f"{'phase':<11} {'seconds':>8} {'requests':>9} {'non-200':>8} {'output tok/s':>13}")
    for phase, row in phases.items():
        print(f"{phase:<11} {row['seconds']:>8.1f} {row['requests']:>9d} {row['non_200']:>8d} {row['output_tok_s']:>13.1f}")


if __name__ == "__main__":
    main()
