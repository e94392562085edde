"""Dense layers of one decode step: the C++ small-batch kernel against XLA's dot, per row count.

Every projection of the bundled model (30 layers' fused QKV, output, fused gate/up and down,
plus the tied LM head) runs once per call with the model's own float32 weights, so weights
stream from memory as in a real step (540 MB, far above the caches). A third path runs the
block kernel on the same matrices kept in their GGUF blocks (model/quantization/gguf_blocks.py, 112 MB);
its results must equal the float32 kernel's bit for bit, which the script checks. With
``--quantized``, two more paths run the 8-bit kernel on the same matrices quantized per output
channel (``model.quantization: int8`` and ``fp8``, 135 MB each). The paths are jitted programs
over the same arrays and are timed in alternating rounds; the ratio columns are XLA's time over
the kernel's and the float32 kernel's over the block kernel's (above 1: the second is faster).
This is what ``model.kernels.dense``'s ``KERNEL_MAX_ROWS`` is chosen from.

    python -m raylm.benchmarks.dense_bench [--rows 1,2,4,8,16,32,64] [--rounds 5] [--quantized]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def _matrices() -> tuple[list[jax.Array], list]:
    """Every matmul weight of the bundled model as a 2-D ``[N, K]`` float32 array, and the same
    matrices as 2-D GGUF blocks."""
    from raylm.model.config.registry import DEFAULT_MODEL, resolve_model_path
    from raylm.model.loaders.gguf_checkpoint import load_gguf_checkpoint

    def flat(params: object) -> list:
        out = []
        for layer in params.layers:
            out += [layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down]
        out.append(params.lm_head if params.lm_head is not None else params.embed)
        return out

    path = resolve_model_path(DEFAULT_MODEL)
    blocks = [w.flat() for w in flat(load_gguf_checkpoint(path, keep_blocks=True)[1])]
    floats = [w.reshape(b.shape) for w, b in zip(flat(load_gguf_checkpoint(path)[1]), blocks)]
    return floats, blocks


def _program(matmul: Callable[[jax.Array, jax.Array], jax.Array]) -> Callable:
    """One jitted call multiplying per-K input rows by every matrix (outputs summed so none is dead)."""

    @jax.jit
    def run(inputs: dict[int, jax.Array], weights: list[jax.Array]) -> jax.Array:
        return sum(jnp.sum(matmul(inputs[w.shape[1]], w)) for w in weights)

    return run


def time_ms(run: Callable, *args: object) -> float:
    """Wall milliseconds of one call of ``run``, its result fetched (jax dispatch is async)."""
    start = time.perf_counter()
    jax.block_until_ready(run(*args))
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,24,32,48,64")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quantized", action="store_true", help="also time int8 and fp8 per-channel weights")
    args = parser.parse_args()

    from raylm.model.kernels.dense import dense_matmul, gguf_matmul, quantized_matmul
    from raylm.model.quantization.quant_array import quantize

    floats, blocks = _matrices()
    paths = {"kernel": (_program(dense_matmul), floats),
             "blocks": (_program(gguf_matmul), blocks),
             "xla": (_program(lambda x, w: jnp.einsum("mk,nk->mn", x, w)), floats)}
    if args.quantized:
        for scheme in ("int8", "fp8"):
            paths[scheme] = (_program(quantized_matmul), [quantize(w, scheme) for w in floats])
    exact = jax.jit(lambda x, w, b: jnp.all(dense_matmul(x, w) == gguf_matmul(x, b)))
    rng = np.random.default_rng(0)
    extra = [name for name in ("int8", "fp8") if name in paths]
    print(f"{'rows':>5} {'kernel ms':>10} {'blocks ms':>10} {'xla ms':>10} {'xla/kernel':>11} {'kernel/blocks':>14}"
          + "".join(f" {name + ' ms':>9}" for name in extra))
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: jnp.asarray(rng.standard_normal((rows, k)), jnp.float32) for k in {w.shape[1] for w in floats}}
        if not all(bool(exact(inputs[w.shape[1]], w, b)) for w, b in zip(floats, blocks)):
            raise SystemExit(f"{rows} rows: the block kernel's results differ from the float32 kernel's")
        times: dict[str, list[float]] = {name: [] for name in paths}
        for run, weights in paths.values():
            time_ms(run, inputs, weights)  # compile
        for _ in range(args.rounds):
            for name, (run, weights) in paths.items():
                times[name].append(time_ms(run, inputs, weights))
        kernel, block, xla = (statistics.median(times[name]) for name in ("kernel", "blocks", "xla"))
        print(f"{rows:>5} {kernel:>10.1f} {block:>10.1f} {xla:>10.1f} {xla / kernel:>10.2f}x {kernel / block:>13.2f}x"
              + "".join(f" {statistics.median(times[name]):>9.1f}" for name in extra), flush=True)


if __name__ == "__main__":
    main()
