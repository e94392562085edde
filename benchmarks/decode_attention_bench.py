"""Decode attention: the C++ paged kernel against the jnp ``paged_attention`` reference.

Both run the way ``model.decoder.forward`` runs a decode step: one jitted program, the stacked KV
pool donated, and per layer (``lax.scan`` over a traced layer index) this token's K/V
scattered into the pool right before attention reads it. Every row has ``context`` keys
and the block table is padded to a wider bucket (the power of two above the row's blocks
plus one, at least 8), as the engine pads. Old and new alternate in rounds in one process,
so the ratio holds on a shared machine even when absolute times drift.

    python -m raylm.benchmarks.decode_attention_bench [--rows 1 4 16 64] [--contexts 64 256 1024]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from raylm.model.decoder.attention import slot_indices, write_kv
from raylm.model.kernels import paged_decode
from raylm.model.runtime.buckets import bucket, cdiv

MODEL_LAYERS = 30  # the bundled SmolLM2-135M: one decode step runs attention this many times
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
MIN_WIDTH = 8


def width_bucket(context: int) -> int:
    """Block-table width the engine would use for a batch whose longest row needs one block more."""
    return bucket(cdiv(context, BLOCK_SIZE) + 1, MIN_WIDTH, 1 << 30)


def attention_step(attention: Callable, k_pool, v_pool, q, k_new, v_new, block_tables, context_lens):
    """Per layer: write this token's K/V into the pool, then attend (as ``model.decoder.forward`` does)."""
    positions = (context_lens - 1)[:, None]
    block, offset = slot_indices(positions, block_tables, (context_lens > 0)[:, None], k_pool.shape[2])

    def layer(pools, inputs):
        k_pool, v_pool = pools
        i, q, k, v = inputs
        k_pool = write_kv(k_pool, i, block, offset, k[:, None])
        v_pool = write_kv(v_pool, i, block, offset, v[:, None])
        return (k_pool, v_pool), attention(q, k_pool, v_pool, i, block_tables, context_lens)

    ids = jnp.arange(k_pool.shape[0])
    (k_pool, v_pool), out = jax.lax.scan(layer, (k_pool, v_pool), (ids, q, k_new, v_new))
    return out, k_pool, v_pool


def bench_case(rows: int, context: int, layers: int, rounds: int, seed: int = 0) -> dict[str, float]:
    """Median seconds per jitted step for the reference and the kernel, measured alternately."""
    rng = np.random.default_rng(seed)
    width, used = width_bucket(context), cdiv(context, BLOCK_SIZE)
    num_blocks = rows * used + 1
    pool_shape = (layers, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    tables = np.zeros((rows, width), np.int32)  # padding slots point at the null block
    tables[:, :used] = rng.permutation(np.arange(1, num_blocks)).reshape(rows, used)
    args = (
        jnp.asarray(rng.standard_normal((layers, rows, HEADS, HEAD_DIM)), jnp.float32),
        jnp.asarray(rng.standard_normal((layers, rows, KV_HEADS, HEAD_DIM)), jnp.float32),
        jnp.asarray(rng.standard_normal((layers, rows, KV_HEADS, HEAD_DIM)), jnp.float32),
        jnp.asarray(tables),
        jnp.full((rows,), context, jnp.int32),
    )
    variants = {
        "reference": paged_decode.reference_decode_attention,
        "kernel": paged_decode.paged_decode_attention,
    }
    initial = [rng.standard_normal(pool_shape, np.float32) for _ in range(2)]  # same pool for both
    pools, steps, times = {}, {}, {name: [] for name in variants}
    for name, attention in variants.items():
        pools[name] = tuple(jnp.array(p) for p in initial)
        steps[name] = jax.jit(functools.partial(attention_step, attention), donate_argnums=(0, 1))
        _, *pools[name] = steps[name](*pools[name], *args)  # compile
    outs = {}
    for _ in range(rounds):
        for name in variants:
            start = time.perf_counter()
            outs[name], *pools[name] = steps[name](*pools[name], *args)
            outs[name].block_until_ready()
            times[name].append(time.perf_counter() - start)
    err = float(np.max(np.abs(np.asarray(outs["kernel"]) - np.asarray(outs["reference"]))))
    return {name: statistics.median(t) for name, t in times.items()} | {"max_abs_diff": err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--layers", type=int, default=4, help="layers per jitted step (pool memory grows with it)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if not paged_decode.available():
        raise SystemExit("the C++ kernel is not built here (see the warning above); nothing to compare")

    print(f"decode attention, float32, {HEADS} heads / {KV_HEADS} kv heads, head_dim {HEAD_DIM}, "
          f"block {BLOCK_SIZE}; {args.layers} layers per jitted step, median of {args.rounds} alternating rounds")
    print(f"{'rows':>4} {'context':>7} {'width':>5} | {'ref ms/layer':>12} {'kernel ms/layer':>15} | "
          f"{'ref ms/step':>11} {'kernel ms/step':>14} | {'speedup':>7} | max|diff|")
    for context in args.contexts:
        for rows in args.rows:
            r = bench_case(rows, context, args.layers, args.rounds)
            ref, ker = r["reference"] / args.layers * 1e3, r["kernel"] / args.layers * 1e3
            print(f"{rows:>4} {context:>7} {width_bucket(context):>5} | {ref:>12.3f} {ker:>15.3f} | "
                  f"{ref * MODEL_LAYERS:>11.1f} {ker * MODEL_LAYERS:>14.1f} | {ref / ker:>6.1f}x | "
                  f"{r['max_abs_diff']:.1e}", flush=True)
    print(f"(ms/step = ms/layer x {MODEL_LAYERS} layers of the bundled model; both include the K/V scatter)")


if __name__ == "__main__":
    main()
