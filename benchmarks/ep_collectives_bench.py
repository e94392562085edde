"""The collective an expert-parallel MoE layer needs, two ways, per token count.

raylm's expert parallelism keeps attention replicated (or tensor-parallel) over the ``ep`` axis,
so every device already holds every token: each device runs its own experts on the tokens routed
to them and one all-reduce (``psum`` of ``[tokens, hidden]``) sums the experts' outputs. The
other design, data-parallel attention (each device holds ``tokens / ep`` of the batch; DeepSeek,
Ray Serve LLM's DP + EP), needs two all-to-alls per MoE layer instead: dispatch each token's
``top_k`` copies to the devices of its experts, and return the results. This times both
collectives alone (``shard_map`` over ``--devices`` forced host devices, balanced routing, no
expert compute), as jitted programs in alternating rounds (median), and prints the bytes each
device sends. On one CPU host the "network" is memory, so this shows the collectives' overhead
in an XLA program; across hosts the bytes column is what scales.

    python -m raylm.benchmarks.ep_collectives_bench [--devices 2] [--tokens 1,16,64,256]
        [--hidden 2048] [--top-k 2] [--rounds 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tokens", default="1,16,64,256")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args(argv)
    if "jax" in sys.modules:
        raise SystemExit("run as its own process: the device count is set before JAX starts")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[: args.devices]), ("ep",))
    ep = args.devices

    def all_reduce(partial):  # [ep * T, H]: each device's partial sum of every token's output
        return jax.shard_map(lambda y: jax.lax.psum(y, "ep"), mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(partial)

    def all_to_all_twice(slots):  # [ep * ep * C, H]: per device, C routed copies for each device
        def dispatch_and_return(y):
            y = y.reshape(ep, -1, y.shape[-1])
            there = jax.lax.all_to_all(y, "ep", 0, 0, tiled=True)  # tokens to their experts' devices
            back = jax.lax.all_to_all(there + 1.0, "ep", 0, 0, tiled=True)  # (expert output) back home
            return back.reshape(-1, y.shape[-1])

        return jax.shard_map(dispatch_and_return, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(slots)

    reduce_fn, a2a_fn = jax.jit(all_reduce), jax.jit(all_to_all_twice)
    print(f"{ep} devices ({jax.devices()[0].platform}), hidden {args.hidden}, top-{args.top_k}, float32; "
          f"median of {args.rounds} alternating rounds")
    print(f"{'tokens':>7} {'all-reduce us':>14} {'sent/device':>12} {'2x all-to-all us':>17} {'sent/device':>12}")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        # all-reduce: every device holds all tokens' partial outputs; a ring sends 2 (ep-1)/ep of them.
        partial = jnp.ones((ep * tokens, args.hidden), jnp.float32)
        # all-to-all: a device holds tokens/ep tokens, top_k copies each, (ep-1)/ep of them leave it, twice.
        per_device = max(1, -(-tokens // ep)) * args.top_k
        capacity = max(1, -(-per_device // ep))
        slots = jnp.ones((ep * ep * capacity, args.hidden), jnp.float32)
        times: dict[str, list[float]] = {"reduce": [], "a2a": []}
        for fn, x in ((reduce_fn, partial), (a2a_fn, slots)):
            fn(x).block_until_ready()
        for _ in range(args.rounds):
            for name, fn, x in (("reduce", reduce_fn, partial), ("a2a", a2a_fn, slots)):
                start = time.perf_counter()
                fn(x).block_until_ready()
                times[name].append(time.perf_counter() - start)
        row_bytes = args.hidden * 4
        reduce_sent = 2 * (ep - 1) / ep * tokens * row_bytes
        a2a_sent = 2 * (ep - 1) * capacity * row_bytes
        print(f"{tokens:>7} {statistics.median(times['reduce']) * 1e6:>14.0f} {reduce_sent / 1024:>10.0f} KiB "
              f"{statistics.median(times['a2a']) * 1e6:>17.0f} {a2a_sent / 1024:>10.0f} KiB")


if __name__ == "__main__":
    main()
