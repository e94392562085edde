"""Expert parallelism served: output tokens/s of a random-weight MoE at EP=1 and EP=N, same run.

A Qwen3-MoE checkpoint of the 1.1B shape (benchmarks/random_checkpoint.py's ``qwen3moe-1b``:
Qwen3 attention, 8 experts of 1024 in each of 16 layers, top-2, the bundled tokenizer; random
weights, so outputs are noise and requests ignore EOS) is loaded in float32 and served by the
offline engine twice in one process over ``--ep`` forced host devices: one replica on one
device (EP=1), then one whose experts are split over ``--ep`` devices (model/decoder/expert_parallel.py).
Each replica serves ``--requests`` requests with ``--streams`` in flight (a finished one replaced
before the next step), after a warm-up pass over other prompts that compiles its buckets; the
figures are output tokens over the measured pass's wall time, and EP=N / EP=1.

    python -m raylm.benchmarks.ep_bench [--model DIR] [--ep 2] [--streams 16] [--requests 32]
        [--prompt-len 64] [--output-len 64] [--layers 16] [--rounds 1]

Without ``--model`` it writes the checkpoint into a temporary directory first (needs torch and
transformers, and the bundled model for its tokenizer); ``--layers`` shortens the written model.
With ``--rounds R`` the two replicas alternate R times (both stay loaded) and the medians are
printed. Run it as its own process: the device count is set before JAX starts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def serve_rates(path: Path, ep: int, *, streams: int, requests: int, prompt_len: int, output_len: int,
                rounds: int = 1) -> dict[int, list[float]]:
    """Output tokens/s of each round, for EP=1 and EP=``ep`` replicas of the checkpoint at ``path``
    (both loaded in float32 on this process's devices, which must number at least ``ep``)."""
    import numpy as np

    from raylm.benchmarks.offline_bench import run_engine
    from raylm.model.loaders.load import load_model
    from raylm.workers.core.sampling_params import SamplingParams
    from raylm.workers.engine.engine_args import EngineArgs
    from raylm.workers.engine.llm_engine import LLMEngine

    model = load_model(path, "float32")
    rng = np.random.RandomState(0)
    vocab = model.config.vocab_size
    first = min(1000, vocab // 2)  # ordinary tokens: past the special/control range at the start

    def prompts(count: int) -> list[list[int]]:
        return [rng.randint(first, vocab, size=prompt_len).tolist() for _ in range(count)]

    greedy = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    blocks_per_request = -(-(prompt_len + output_len) // 16) + 1
    engines = {}
    for size in (1, ep):
        args = EngineArgs(max_model_len=prompt_len + output_len + 16, max_num_seqs=streams,
                          num_kv_blocks=streams * blocks_per_request + 1, expert_parallel_size=size)
        engines[size] = LLMEngine(model, args)
        run_engine(engines[size], prompts(streams), greedy, concurrency=streams)  # compile the buckets
    rates: dict[int, list[float]] = {1: [], ep: []}
    for _ in range(rounds):
        measured = prompts(requests)  # the same prompts for both replicas within a round
        for size, engine in engines.items():
            rates[size].append(run_engine(engine, measured, greedy, concurrency=streams)["tok_s"])
    return rates


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="an HF MoE checkpoint (default: write one)")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=None, help="layers of the written checkpoint (default 16)")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    if args.ep < 2:
        parser.error("--ep compares EP=N against EP=1: give N >= 2")
    if "jax" in sys.modules:
        raise SystemExit("run as its own process: the device count is set before JAX starts")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.ep}"

    with tempfile.TemporaryDirectory() as scratch:
        path = args.model or _write_checkpoint(Path(scratch), args.layers)
        start = time.perf_counter()
        rates = serve_rates(path, args.ep, streams=args.streams, requests=args.requests, prompt_len=args.prompt_len,
                            output_len=args.output_len, rounds=args.rounds)
    _report(rates, args, time.perf_counter() - start)


def _write_checkpoint(directory: Path, layers: int | None) -> Path:
    from raylm.benchmarks.random_checkpoint import SHAPES, export_tokenizer, write_random_checkpoint

    shape: dict[str, Any] = dict(SHAPES["qwen3moe-1b"])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    tokenizer = export_tokenizer(directory / "tokenizer")
    print(f"writing a random Qwen3-MoE ({shape['num_hidden_layers']} layers) ...", flush=True)
    return write_random_checkpoint(directory / "checkpoint", tokenizer, shape)


def _report(rates: dict[int, list[float]], args: argparse.Namespace, seconds: float) -> None:
    one, split = (statistics.median(rates[size]) for size in (1, args.ep))
    print(f"\n== {args.requests} requests x ({args.prompt_len} prompt + {args.output_len} output tokens), "
          f"{args.streams} in flight, float32, {args.rounds} round(s), {seconds:.0f} s ==")
    for size, median in ((1, one), (args.ep, split)):
        print(f"EP={size}  {median:8.1f} output tok/s  (rounds: {', '.join(f'{r:.1f}' for r in rates[size])})")
    print(f"EP={args.ep} / EP=1: {split / one:.2f}x")


if __name__ == "__main__":
    main()
