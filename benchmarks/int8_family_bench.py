"""The integer mode's kernel families against each other on one matrix, same process (AMX vs VNNI).

Each family (``model.kernels.int8_matmul.use_family``: AMX tiles, AVX-512 VNNI, AVX2, portable) runs
the same packed weights (model/quantization/int8_panels.py, as the engine packs them at load) on the
same rows; rounds alternate between the families (medians), every family's result is checked equal
to the first's bit for bit, and GOP/s counts 2 M N K operations per call by the wall clock. The
ratio columns are each family's speed over the last family listed (the baseline: VNNI by default), by
the wall clock and per CPU second (all threads; what holds on a shared machine).
A family this CPU lacks runs as the best one below it, and the table says which ran. Default: a
Llama-3.2-1B-shaped 2048 x 8192 matrix (``[N, K]`` as stored) and its 8192 x 2048 transpose shape.

    python -m raylm.benchmarks.int8_family_bench [--formats Q4_0,Q4_K,Q8_0,int8] [--families amx,vnni]
        [--shapes 2048x8192,8192x2048] [--rows 16,128,512] [--rounds 5]
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from raylm.benchmarks.prompt_gemm_bench import gflops, seconds, weights_in
from raylm.model.kernels import int8_matmul
from raylm.model.quantization.int8_panels import pack_int8_panels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="Q4_0,Q4_K,Q8_0,int8", help="GGUF types the integer kernel reads, or int8")
    parser.add_argument("--families", default="amx,vnni", help="the last one is the baseline of the ratio")
    parser.add_argument("--shapes", default="2048x8192,8192x2048", help="N x K of each matrix, as stored")
    parser.add_argument("--rows", default="16,128,512")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    families = args.families.split(",")
    ran = {name: int8_matmul.use_family(name) for name in families}
    print(f"families (asked: ran) {ran}; {jax.device_count()} CPU device, process default "
          f"{int8_matmul.use_family('')}")
    print(f"{'format':>7} {'N x K':>11} {'rows':>5} " + " ".join(f"{name + ' GOP/s':>11}" for name in families) +
          " " + " ".join(f"{name + '/' + families[-1]:>11}" for name in families[:-1]) +
          " " + " ".join(f"{'per CPU-s':>13}" for _ in families[:-1]))
    run = jax.jit(int8_matmul.int8_matmul)
    rng = np.random.default_rng(0)
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            (stored,) = weights_in(fmt, [(n, k)])
            packed = pack_int8_panels(stored)
            for rows in (int(r) for r in args.rows.split(",")):
                x = jax.numpy.asarray(rng.standard_normal((rows, k)), jax.numpy.float32)
                results = []
                for name in families:
                    int8_matmul.use_family(name)
                    results.append(np.asarray(run(x, packed)))  # compiles once; the family is read per call
                    if not np.array_equal(results[0], results[-1]):
                        raise AssertionError(f"{fmt} {shape} {rows} rows: {name} differs from {families[0]}")
                times: dict[str, list[tuple[float, float]]] = {name: [] for name in families}
                for _ in range(args.rounds):
                    for name in families:
                        int8_matmul.use_family(name)
                        times[name].append(seconds(run, x, packed))
                speed = [gflops(2 * rows * n * k, times[name]) for name in families]
                print(f"{fmt:>7} {shape:>11} {rows:>5} " + " ".join(f"{s[0]:>11.0f}" for s in speed) + " " +
                      " ".join(f"{s[0] / speed[-1][0]:>10.2f}x" for s in speed[:-1]) + " " +
                      " ".join(f"{s[1] / speed[-1][1]:>12.2f}x" for s in speed[:-1]), flush=True)
    int8_matmul.use_family("")


if __name__ == "__main__":
    main()
