"""Dense layers of one decode step: the C++ small-batch kernel against XLA's dot, per row count.

Every projection of the bundled model (30 layers' fused QKV, output, fused gate/up and down,
plus the tied LM head) runs once per call with the model's own float32 weights, so weights
stream from memory as in a real step (540 MB, far above the caches). Both paths are jitted
programs over the same arrays and are timed in alternating rounds; the ratio column is XLA's
time over the kernel's (above 1: the kernel is faster). This is what ``model.dense``'s
``KERNEL_MAX_ROWS`` is chosen from.

    python -m deploy.benchmarks.dense_bench [--rows 1,2,4,8,16,32,64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def _matrices() -> list[jax.Array]:
    """Every matmul weight of the bundled model as a 2-D ``[N, K]`` float32 array."""
    from model import DEFAULT_MODEL, load_model

    params = load_model(DEFAULT_MODEL, "float32").params
    out = []
    for layer in params.layers:
        out += [layer.wqkv.reshape(-1, layer.wqkv.shape[-1]), layer.wo.reshape(layer.wo.shape[0], -1),
                layer.w_gate_up.reshape(-1, layer.w_gate_up.shape[-1]), layer.w_down]
    out.append(params.lm_head if params.lm_head is not None else params.embed)
    return out


def _program(matmul: Callable[[jax.Array, jax.Array], jax.Array]) -> Callable:
    """One jitted call multiplying per-K input rows by every matrix (outputs summed so none is dead)."""

    @jax.jit
    def run(inputs: dict[int, jax.Array], weights: list[jax.Array]) -> jax.Array:
        return sum(jnp.sum(matmul(inputs[w.shape[1]], w)) for w in weights)

    return run


def _time(run: Callable, *args: object) -> float:
    start = time.perf_counter()
    jax.block_until_ready(run(*args))
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,24,32,48,64")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from model.dense import dense_matmul

    weights = _matrices()
    paths = {"kernel": _program(dense_matmul),
             "xla": _program(lambda x, w: jnp.einsum("mk,nk->mn", x, w))}
    rng = np.random.default_rng(0)
    print(f"{'rows':>5} {'kernel ms':>10} {'xla ms':>10} {'xla/kernel':>11}")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: jnp.asarray(rng.standard_normal((rows, k)), jnp.float32) for k in {w.shape[1] for w in weights}}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for run in paths.values():
            _time(run, inputs, weights)  # compile
        for _ in range(args.rounds):
            for name, run in paths.items():
                times[name].append(_time(run, inputs, weights))
        kernel, xla = (statistics.median(times[name]) for name in ("kernel", "xla"))
        print(f"{rows:>5} {kernel:>10.1f} {xla:>10.1f} {xla / kernel:>10.2f}x", flush=True)


if __name__ == "__main__":
    main()
