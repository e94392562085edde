"""Prompt chunks' matmuls: the prompt GEMM against XLA's dot, as GFLOP/s and against the
machine's float32 GEMM peak.

The peak is XLA's own dot on a large float32 GEMM (``--peak-shape``, default 2048 x 4096 x 4096),
what the float32 roofline of a prompt is measured against. Then, for one decoder layer's
matrices (fused QKV, output, fused gate/up, down) of the bundled 135M (hidden 576, ffn 1536,
9/3 heads) and of a Llama-3.2-1B-shaped model (hidden 2048, ffn 8192, 32/8 heads), random
weights in each format (float32; int8 per channel; GGUF Q4_1 and Q8_0 blocks quantized by the
gguf package), and 128 / 256 / 512-row chunks:

- ``kernel``: ``model.kernels.dense`` as the engine runs it on CPU (more than ``KERNEL_MAX_ROWS``
  rows: the prompt GEMM, reading the weights as stored);
- ``xla``: what ran before it, XLA's dot on the float32 matrix, for 8-bit and block weights
  after widening the whole matrix inside the program (XLA's convert, or the jnp dequantization
  of the blocks; before the prompt GEMM the blocks were widened by a C++ pass instead, which is
  at best the dot alone: ``xla`` of the float32 rows).

Each path is a jitted program over the layer's four matrices, timed in alternating rounds
(median), by the wall clock and by the process's CPU time (all threads): GFLOP per CPU second
is each core's efficiency, which holds on a machine shared with other work, where the wall
clock does not. The script first checks that each format's kernel rows equal the same rows computed
in calls of ``KERNEL_MAX_ROWS`` rows (the small-batch kernel), bit for bit.

    python -m raylm.benchmarks.prompt_gemm_bench [--models 135m,1b] [--rows 128,256,512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import gguf.quants
import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from raylm.benchmarks.random_blocks import random_blocks
from raylm.model.kernels.dense import KERNEL_MAX_ROWS, dense
from raylm.model.quantization.gguf_blocks import GgufBlocks, from_gguf
from raylm.model.quantization.quant_array import QuantArray, quantize

# hidden, ffn, query heads, KV heads (head dim 64 for both)
MODELS = {"135m": (576, 1536, 9, 3), "1b": (2048, 8192, 32, 8)}
FORMATS = ("float32", "int8", "Q4_1", "Q8_0")
_GGUF_QUANTIZES = {GGMLQuantizationType[t] for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")}


def layer_shapes(hidden: int, ffn: int, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """[N, K] of one decoder layer's matrices: fused QKV, output, fused gate/up, down."""
    qkv = (heads + 2 * kv_heads) * 64
    return [(qkv, hidden), (hidden, heads * 64), (2 * ffn, hidden), (hidden, ffn)]


def weights_in(fmt: str, shapes: list[tuple[int, int]], seed: int = 0) -> list[Any]:
    """Random ``[N, K]`` matrices in ``fmt``, as the engine holds them (GGUF types the gguf package
    cannot quantize: random blocks, ``K`` a multiple of their 256-weight super-blocks)."""
    rng = np.random.default_rng(seed)
    out: list[Any] = []
    for n, k in shapes:
        w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        if fmt == "float32":
            out.append(jnp.asarray(w))
        elif fmt == "int8":
            out.append(quantize(jnp.asarray(w), "int8"))
        else:  # random blocks for the types the gguf package cannot quantize (the K-quants)
            kind = GGMLQuantizationType[fmt]
            data = gguf.quants.quantize(w, kind) if kind in _GGUF_QUANTIZES else random_blocks(kind, (n, k), seed)
            out.append(from_gguf(data, kind, (n, k)).to_device())
    return out


def xla_matmul(x: jax.Array, w: Any) -> jax.Array:
    """What ran before the prompt GEMM: XLA's dot on the whole matrix as float32, 8-bit weights
    converted (and the product scaled) and blocks dequantized inside the program."""
    if isinstance(w, QuantArray):
        return jnp.einsum("mk,nk->mn", x, w.q.astype(jnp.float32)) * w.scale
    if isinstance(w, GgufBlocks):
        w = w.dequantize()
    return jnp.einsum("mk,nk->mn", x, w)


def program(path: str) -> Callable:
    """A jitted call of every matrix on the rows of its K (outputs returned, so none is dead)."""
    matmul = functools.partial(dense, kernel=True) if path == "kernel" else xla_matmul

    @jax.jit
    def run(inputs: dict[int, jax.Array], weights: list[Any]) -> list[jax.Array]:
        return [matmul(inputs[w.shape[1]], w) for w in weights]

    return run


def seconds(run: Callable, *args: object) -> tuple[float, float]:
    """Wall and process CPU seconds of one call, its results fetched (jax dispatch is async)."""
    wall, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(run(*args))
    return time.perf_counter() - wall, time.process_time() - cpu


def gflops(flops: int, times: list[tuple[float, float]]) -> tuple[float, float]:
    """GFLOP per wall second and per CPU second, from the median times."""
    return tuple(flops / statistics.median(t[i] for t in times) / 1e9 for i in (0, 1))  # type: ignore[return-value]


def float32_peak(m: int, n: int, k: int, rounds: int) -> tuple[float, float]:
    """XLA's dot on a large float32 GEMM: GFLOP/s and GFLOP per CPU second (medians of ``rounds``)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    dot = jax.jit(lambda x, w: jnp.einsum("mk,nk->mn", x, w))
    seconds(dot, x, w)
    return gflops(2 * m * n * k, [seconds(dot, x, w) for _ in range(rounds)])


def check_rows(weights: list[Any], inputs: dict[int, jax.Array], fmt: str) -> None:
    """The kernel's rows equal the same rows in calls of ``KERNEL_MAX_ROWS`` rows, bit for bit."""
    run = program("kernel")
    whole = run(inputs, weights)
    step = KERNEL_MAX_ROWS
    rows = next(iter(inputs.values())).shape[0]
    for start in range(0, rows, step):
        part = run({k: x[start : start + step] for k, x in inputs.items()}, weights)
        for a, b in zip(whole, part):
            if not np.array_equal(np.asarray(a[start : start + step]), np.asarray(b)):
                raise SystemExit(f"{fmt}: rows {start}.. differ between the prompt GEMM and the small-batch kernel")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="135m,1b")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--rows", default="128,256,512")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peak-shape", default="2048,4096,4096", help="M,N,K of the float32 GEMM peak")
    args = parser.parse_args()

    m, n, k = (int(v) for v in args.peak_shape.split(","))
    peak, peak_cpu = float32_peak(m, n, k, args.rounds)
    print(f"float32 GEMM peak (XLA dot, {m} x {n} x {k}): {peak:.0f} GFLOP/s, {peak_cpu:.0f} GFLOP per CPU second",
          flush=True)
    print(f"{'model':>5} {'format':>8} {'rows':>5} {'kernel GF/s':>12} {'% peak':>7} {'xla GF/s':>9} {'kernel/xla':>11}"
          f" {'kernel GF/cpu-s':>16} {'% peak':>7} {'xla GF/cpu-s':>13}")
    rng = np.random.default_rng(0)
    for model in args.models.split(","):
        shapes = layer_shapes(*MODELS[model])
        for fmt in args.formats.split(","):
            weights = weights_in(fmt, shapes)
            for rows in (int(r) for r in args.rows.split(",")):
                sizes = {k for _, k in shapes}
                inputs = {k: jnp.asarray(rng.standard_normal((rows, k)), jnp.float32) for k in sizes}
                check_rows(weights, inputs, fmt)
                runs = {path: program(path) for path in ("kernel", "xla")}
                for run in runs.values():
                    seconds(run, inputs, weights)  # compile
                times: dict[str, list[tuple[float, float]]] = {path: [] for path in runs}
                for _ in range(args.rounds):
                    for path, run in runs.items():
                        times[path].append(seconds(run, inputs, weights))
                flops = sum(2 * rows * n * k for n, k in shapes)
                (kernel, kernel_cpu), (xla, xla_cpu) = (gflops(flops, times[p]) for p in ("kernel", "xla"))
                print(f"{model:>5} {fmt:>8} {rows:>5} {kernel:>12.0f} {100 * kernel / peak:>6.0f}% {xla:>9.0f} "
                      f"{kernel / xla:>10.2f}x {kernel_cpu:>16.0f} {100 * kernel_cpu / peak_cpu:>6.0f}% "
                      f"{xla_cpu:>13.0f}", flush=True)


if __name__ == "__main__":
    main()
