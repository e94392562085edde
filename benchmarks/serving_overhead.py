"""What HTTP, the router and Ray cost: served throughput / offline engine throughput, one script.

Both runs use the deploy file's engine settings and the same token-id prompts (the
``raylm bench`` prompt generator), greedy, ``ignore_eos``, ``--output-tokens`` each:

1. offline: an ``LLMEngine`` in this process, built as the worker builds it (same model
   loading, GGUF blocks included), stepped to completion with the workload's concurrency:
   that many requests in flight, each finished one replaced before the next step (the
   engine alone);
2. served: the deploy file on a local Ray cluster (one worker replica unless the file says
   otherwise), the same requests as streaming ``/v1/completions`` from that many clients.

Both are warmed with a full workload of other prompts first (compilation; other prefixes too),
then measured in alternating rounds, one at a time so they never share the CPU, each round
with fresh prompts: on a shared machine whose speed drifts by tens of percent between
minutes, only measurements taken side by side compare. The Ray cluster stays up (idle) during
the offline runs. The ratio served / offline is the serving overhead's complement (goal >= 0.9);
the median over rounds is reported.

    python -m raylm.benchmarks.serving_overhead [--config deploy/default.yaml] [--workload shared-prefix]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import statistics
from collections.abc import Iterator

from raylm.benchmarks.http_bench import WORKLOADS, Workload, make_prompts, run_workload
from raylm.benchmarks.local_serve import local_serve
from raylm.benchmarks.offline_bench import run_engine
from raylm.deploy.config import DeployConfig, load_deploy_config


class OfflineRunner:
    """The deploy file's engine in this process: the same model, engine args and sampling."""

    def __init__(self, config: DeployConfig, workload: Workload):
        from raylm.workers.core.sampling_params import SamplingParams
        from raylm.workers.engine.llm_engine import make_engine

        # As the worker builds it: a GGUF's blocks kept or expanded as the deploy file says.
        self.engine = make_engine(config.model.name, **dataclasses.asdict(config.engine_args()))
        self.params = SamplingParams(max_tokens=workload.output_tokens, temperature=0, ignore_eos=True)
        self.workload = workload

    def tok_s(self, seed: int) -> float:
        prompts = make_prompts(self.workload, seed=seed)
        return run_engine(self.engine, prompts, self.params, self.workload.concurrency)["tok_s"]


@contextlib.contextmanager
def served_endpoint(config: DeployConfig, port: int) -> Iterator[str]:
    """The deploy file served on a private local Ray cluster; yields the base URL."""
    from ray import serve

    from raylm.deploy.app_builder import build_application

    with local_serve(port) as base:
        serve.run(build_application(config), name=config.name, route_prefix="/")
        yield base


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deploy/default.yaml")
    parser.add_argument("--workload", choices=list(WORKLOADS), default=None,
                        help="a raylm bench workload instead of the flags below")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=None, help="default: --num-requests (all at once)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="alternating offline/served measurements")
    parser.add_argument("--port", type=int, default=8020)
    args = parser.parse_args(argv)
    config = load_deploy_config(args.config)
    workload = WORKLOADS[args.workload] if args.workload else Workload(
        "overhead", num_requests=args.num_requests, concurrency=args.concurrency or args.num_requests,
        prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens)
    model = config.served_model_name
    print(f"workload: {dataclasses.asdict(workload)}; engine: max_num_seqs {config.engine.max_num_seqs}, "
          f"num_scheduler_steps {config.engine.num_scheduler_steps}, dtype {config.model.dtype}", flush=True)
    with served_endpoint(config, args.port) as base:
        offline = OfflineRunner(config, workload)
        offline.tok_s(seed=1)  # warm-up: compiles every shape bucket; different prompts than measured
        asyncio.run(run_workload(base, model, workload, seed=1, warmup=0))
        ratios = []
        for round_index in range(args.rounds):
            # Fresh prompts each round (a new seed), so neither side reuses the other's prefix cache.
            seed = 100 + round_index
            offline_tok_s = offline.tok_s(seed)
            served_tok_s = asyncio.run(run_workload(base, model, workload, seed=seed, warmup=0)).output_tok_s
            ratios.append(served_tok_s / offline_tok_s)
            print(f"round {round_index + 1}: offline engine {offline_tok_s:.1f} output tok/s, served (HTTP + router "
                  f"+ Ray) {served_tok_s:.1f} output tok/s, served / offline {ratios[-1]:.2f}", flush=True)
    print(f"served / offline, median of {len(ratios)} rounds: {statistics.median(ratios):.2f} (goal >= 0.9)")


if __name__ == "__main__":
    main()
