"""Requests served while a new replica warms up: how long they wait, against the same requests
once it has warmed up.

A served engine serves once the programs a request alone takes are compiled and compiles the
rest after (``workers/engine/async_engine.py``). This builds the engine as a worker replica does
(``AsyncEngine.from_model`` with the deploy file's engine settings, so the persistent
compilation cache counts), then at once sends single greedy streaming requests one after
another (``--concurrency`` clients doing so) until the warm-up is done, then ``--after`` more
each. Each request is a fresh token-id prompt of ``--prompt-tokens`` (no prefix cache hits) and
``--output-tokens`` out. It prints the
engine's construction time, when the warm-up finished, and per phase the median and largest
time to first token and gap between two tokens of one stream (a compile on the engine thread shows as a gap
of its length), and a stream's output tokens/s: the first minutes' rate against the warm one.
``--empty-cache`` builds it with an empty compilation cache (a temporary directory), as a
machine's first start does; without it, run it twice to measure with a warm cache.
``--on-engine-thread`` compiles the warm-up on the engine thread between steps, as a runner that
cannot compile beside its steps does (a multi-host leader, a pipeline): the baseline of the
compile thread.

    python -m raylm.benchmarks.warmup_bench [--config deploy/default.yaml] [--empty-cache] [--on-engine-thread]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import statistics
import tempfile
import time

import numpy as np

from raylm.deploy.config import load_deploy_config


@dataclasses.dataclass
class Served:
    """One request: when it started (seconds after the engine was built), its time to first
    token, its largest gap between two tokens, its output tokens and its seconds in all."""

    started_s: float
    ttft_s: float
    max_gap_s: float
    tokens: int
    seconds: float


async def _one(engine, prompt: list[int], params, request_id: str, origin: float) -> Served:
    started = time.monotonic()
    times = [started]
    tokens = 0
    async for output in engine.generate(prompt, params, request_id):  # (a multi-step decode streams several)
        times.append(time.monotonic())
        tokens = len(output.outputs[0].token_ids)
    gaps = np.diff(times[1:])
    return Served(started - origin, times[1] - started, float(gaps.max()) if len(gaps) else 0.0,
                  tokens, times[-1] - started)


async def _measure(engine, args: argparse.Namespace, origin: float) -> tuple[int, list[Served], list[Served], float]:
    """``--concurrency`` clients, each sending one request after another, until the warm-up is
    done and each has sent ``--after`` more."""
    from raylm.workers.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    left = (await engine.stats()).warmup_programs_left
    during: list[Served] = []
    after: list[Served] = []
    warm: list[float] = []

    async def client(index: int) -> None:
        rng = np.random.RandomState(index)
        for i in itertools.count():
            prompt = rng.randint(300, 40_000, size=args.prompt_tokens).tolist()
            served = await _one(engine, prompt, params, f"c{index}-{i}", origin)
            if warm and served.started_s >= warm[0]:
                after.append(served)
                if len(after) >= args.after * args.concurrency:
                    return
            else:
                during.append(served)

    async def watch() -> None:
        """Note when the warm-up ends. Not in the clients' loop: a stats call waits while the
        engine thread compiles (``--on-engine-thread``), and a client waiting on it sends no request."""
        while (await engine.stats()).warmup_programs_left:
            await asyncio.sleep(0.2)
        warm.append(time.monotonic() - origin)

    await asyncio.gather(watch(), *(client(i) for i in range(args.concurrency)))
    return left, during, after, warm[0]


def stream_rate(served: list[Served]) -> float:
    """A stream's output tokens/s over a phase: its requests' tokens over their seconds (a client
    sends the next request as one ends, so this is its rate through the phase)."""
    return sum(s.tokens for s in served) / sum(s.seconds for s in served)


def _line(name: str, served: list[Served]) -> str:
    ttft = [s.ttft_s * 1e3 for s in served]
    gaps = [s.max_gap_s * 1e3 for s in served]
    return (f"{name}: {len(served)} requests; TTFT median {statistics.median(ttft):.0f} ms, max {max(ttft):.0f} ms; "
            f"largest gap between tokens median {statistics.median(gaps):.0f} ms, max {max(gaps):.0f} ms; "
            f"{stream_rate(served):.1f} output tokens/s a stream")


def comparison(during: list[Served], after: list[Served]) -> str:
    """The warm-up's figures over the warm engine's: TTFT median and a stream's output rate."""
    ttft = statistics.median(s.ttft_s for s in during) / statistics.median(s.ttft_s for s in after)
    return (f"during the warm-up / after it: TTFT median {ttft:.2f}x, output tokens/s a stream "
            f"{stream_rate(during) / stream_rate(after):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deploy/default.yaml")
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=1, help="clients, each one request at a time")
    parser.add_argument("--after", type=int, default=8, help="requests per client once the warm-up is done")
    parser.add_argument("--empty-cache", action="store_true",
                        help="an empty compilation cache (a temporary directory) instead of the deploy file's")
    parser.add_argument("--on-engine-thread", action="store_true",
                        help="compile the warm-up on the engine thread between steps, not on a thread of its own")
    args = parser.parse_args()

    from raylm.workers.engine.async_engine import AsyncEngine
    from raylm.workers.runner.model_runner import ModelRunner

    ModelRunner.compiles_off_thread = not args.on_engine_thread

    config = load_deploy_config(args.config)
    engine_args = dataclasses.asdict(config.engine_args())
    with tempfile.TemporaryDirectory(prefix="raylm-empty-cache-") as empty:
        if args.empty_cache:
            engine_args["compilation_cache_dir"] = empty
        started = time.monotonic()
        engine = AsyncEngine.from_model(config.model.name, **engine_args)
        built = time.monotonic()
        try:
            left, during, after, warm_s = asyncio.run(_measure(engine, args, built))
        finally:
            engine.shutdown()
    cache = "an empty" if args.empty_cache else "the deploy file's"
    where = "the engine thread" if args.on_engine_thread else "a compile thread"
    print(f"engine built in {built - started:.1f} s ({cache} compilation cache) with {left} programs left to "
          f"warm up on {where}; warm-up done {warm_s:.1f} s later")
    print(_line("during the warm-up", during))
    print(_line("after it", after))
    print(comparison(during, after))


if __name__ == "__main__":
    main()
