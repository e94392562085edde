"""KV blocks a long generation holds when its layers slide over a window, against full attention.

The bundled SmolLM2-135M cut to its first ``--layers`` layers (its real weights, but a tiny
model: block counts depend on lengths, not weights) is served three times by ``workers.LLM``
with prefix caching and chunked prefill on: with full attention, with a ``--window``-token
sliding window on every layer (as a Mistral or Phi-3 config declares one), and with sliding
and full-attention layers interleaved (every ``--global-every``-th layer global, the others
sliding: 2 as in Gemma 2, 6 as in Gemma 3, five sliding layers to one global; the sliding
layers then keep a KV group of their own, reported apart: "full" / "sliding" blocks), and with
Llama 4's chunked attention on those same local layers (``--window``-token chunks: a query sees
its own chunk's keys; blocks go back behind the span as the sliding ones do). ``--seqs`` random
prompts of ``--prompt`` tokens generate ``--new-tokens`` tokens each (EOS ignored); the pool's
blocks in use are read once every sequence has generated that many (before any finishes and
frees its blocks), with the peak over the run and the bound the engine admits by
(``BlockManager.max_blocks_held``: the window plus one step's tokens, per sequence). "KV MiB"
counts each group's blocks at its own layers' size.

    python -m raylm.benchmarks.sliding_window_kv [--new-tokens 4096] [--window 1024] [--seqs 1]
    python -m raylm.benchmarks.sliding_window_kv --layers 6 --global-every 6   # Gemma 3's shape

Output tokens/s is printed beside them as a sanity check only (one run each, no alternating
rounds); the numbers this script is for are the block counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np


def _run(model, args: argparse.Namespace, local: dict[str, tuple[int | None, ...]]) -> dict[str, float]:
    """Blocks in use per KV group once every sequence has ``args.new_tokens`` outputs, the peak
    (all groups), the KV bytes in use, the bound, and output tokens/s."""
    from raylm.workers.core.sampling_params import SamplingParams
    from raylm.workers.engine.llm import LLM

    served = dataclasses.replace(model, config=dataclasses.replace(model.config, **local))
    context = args.prompt + args.new_tokens + 64
    blocks = args.seqs * (-(-context // args.block_size)) + 1
    llm = LLM(served, block_size=args.block_size, num_kv_blocks=blocks, max_model_len=context,
              max_num_batched_tokens=args.budget, num_scheduler_steps=args.steps)
    engine = llm.engine
    rng = np.random.RandomState(0)
    params = SamplingParams(max_tokens=args.new_tokens + 32, temperature=0.0, ignore_eos=True)
    for i in range(args.seqs):
        engine.add_request(str(i), rng.randint(1000, 20000, args.prompt).tolist(), params)
    pools = [group.pool for group in engine.blocks.groups]
    peak, start = 0, time.perf_counter()
    while True:
        engine.step()
        peak = max(peak, sum(pool.num_used_blocks for pool in pools))
        running = engine.scheduler.running
        if len(running) == args.seqs and min(len(s.output_ids) for s in running) >= args.new_tokens:
            break
    seconds = time.perf_counter() - start
    c = served.config
    layers = [sum(c.kv_group(i) == g for i in range(c.num_layers)) for g in range(len(pools))]
    layer_block_bytes = 2 * args.block_size * c.num_kv_heads * c.head_dim * 4  # K+V float32, one layer
    out = dict(used=[pool.num_used_blocks for pool in pools], peak=peak, usable=engine.pool.num_usable_blocks,
               bound=engine.blocks.max_blocks_held(max(args.budget, args.steps), len(pools) - 1),
               mib=sum(p.num_used_blocks * n for p, n in zip(pools, layers)) * layer_block_bytes / 2**20,
               tok_s=sum(len(s.output_ids) for s in running) / seconds)
    for i in range(args.seqs):
        engine.abort(str(i))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--seqs", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--global-every", type=int, default=2,
                        help="interleaved run: every this-many-th layer global (Gemma 2: 2, Gemma 3: 6)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens (the longest chunk)")
    parser.add_argument("--steps", type=int, default=8, help="num_scheduler_steps")
    args = parser.parse_args()

    from raylm.model.config.registry import DEFAULT_MODEL
    from raylm.model.loaders.load import load_model

    model = load_model(DEFAULT_MODEL, "float32").first_layers(args.layers)
    c = model.config
    block_bytes = 2 * c.num_layers * args.block_size * c.num_kv_heads * c.head_dim * 4
    print(f"{DEFAULT_MODEL} first {c.num_layers} layers, block {args.block_size} tokens "
          f"({block_bytes / 2**10:.0f} KiB float32 K+V), {args.seqs} x ({args.prompt} prompt + "
          f"{args.new_tokens} generated) tokens, chunk {args.budget}, {args.steps} decode steps per call")
    print(f"{'attention':<22}{'blocks in use':>20}{'peak':>7}{'pool':>7}{'KV MiB':>9}{'per-seq bound':>15}{'tok/s':>8}")
    every = (args.window,) * c.num_layers
    interleaved = tuple(None if (i + 1) % args.global_every == 0 else args.window for i in range(c.num_layers))
    runs = [("full", {}), (f"window {args.window}", dict(layer_windows=every)),
            (f"{args.global_every - 1}:1 local {args.window}", dict(layer_windows=interleaved)),
            (f"{args.global_every - 1}:1 chunked {args.window}", dict(layer_chunks=interleaved))]
    for name, local in runs:
        r = _run(model, args, local)
        used = " full / ".join(map(str, r["used"])) + (" sliding" if len(r["used"]) > 1 else "")
        bound = "-" if r["bound"] is None else str(r["bound"])
        print(f"{name:<22}{used:>20}{r['peak']:>7}{r['usable']:>7}{r['mib']:>9.1f}{bound:>15}{r['tok_s']:>8.1f}",
              flush=True)


if __name__ == "__main__":
    main()
