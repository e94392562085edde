"""The integer compute mode's matmul against the exact mode's, on one matrix, same run.

Both run ``model.kernels.dense`` as the engine does on CPU: the exact mode's block kernels (the
small-batch kernel up to ``KERNEL_MAX_ROWS`` rows, the prompt GEMM above) and the integer mode's
kernel (the same weights packed for it at load, as the engine does;
model/quantization/int8_panels.py). Weights are random,
quantized by the gguf package, or random blocks for the K-quants it cannot quantize (default: a
Llama-3.2-1B-shaped 2048 x 8192 matrix, ``[N, K]`` as stored, in Q4_1, and its 8192 x 2048
transpose shape; ``--format Q6_K --shapes 3072x8192,8192x3072`` is a Llama-3.2-3B's down
projection and its transpose shape in the type a Q4_K_M file holds them). Rounds alternate between the modes
(medians); GOP/s counts 2 M N K operations per call, by the wall clock and per CPU second (all
threads; what holds on a shared machine), and the float32 GEMM peak (XLA's dot, as in
prompt_gemm_bench) is printed for scale. ``int/exact`` is the wall-clock speed ratio.
``--against`` adds a third mode, the integer kernel on the same matrix in an older layout (the
same bits), and prints the panels' speed against it: ``float-tables``, float32 tables of two-level
scales' products (``d * sc`` per 32: Q4_K, Q5_K, IQ4_XS); ``code-bytes``, 4-bit codes widened to
bytes of their values (IQ4_NL, IQ4_XS, MXFP4). ``--copies 6`` cycles over six copies of each
matrix, so that a matrix of tens of MB is not still in the last-level cache from the round
before: a decode row's figure as a model's layers see it.

    python -m raylm.benchmarks.int8_matmul_bench [--shapes 2048x8192,8192x2048] [--format Q4_1|Q6_K|...]
        [--rows 1,16,128,512] [--rounds 5] [--copies 6] [--against float-tables|code-bytes]
"""

from __future__ import annotations

import argparse
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from raylm.benchmarks.prompt_gemm_bench import float32_peak, gflops, seconds, weights_in
from raylm.model.kernels.dense import dense
from raylm.model.quantization.gguf_blocks import GgufBlocks
from raylm.model.quantization.int8_panels import pack_int8_panels

# --against: which matrices each older layout applies to, and the matrix brought to it.
OLDER_LAYOUTS: dict[str, tuple[Callable[[GgufBlocks], bool], Callable[[GgufBlocks], GgufBlocks]]] = {
    "float-tables": (lambda w: w.two_level, GgufBlocks.with_float_tables),
    "code-bytes": (lambda w: bool(w.codebook), GgufBlocks.widened),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="2048x8192,8192x2048", help="N x K of each matrix, as stored")
    parser.add_argument("--format", default="Q4_1",
                        help="a GGUF type the integer kernel reads (Q4_1, Q6_K, ...) or int8")
    parser.add_argument("--rows", default="1,16,128,512")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--copies", type=int, default=1,
                        help="calls cycle over this many copies of each matrix (6 or more: more bytes than the "
                             "last-level cache, so every call streams its weights from memory, as a decode step's "
                             "layers do)")
    parser.add_argument("--against", choices=list(OLDER_LAYOUTS),
                        help="also the integer kernel on the matrix in this older layout")
    args = parser.parse_args()

    peak, peak_cpu = float32_peak(2048, 4096, 4096, 3)
    print(f"float32 GEMM peak (XLA dot, 2048 x 4096 x 4096): {peak:.0f} GFLOP/s, {peak_cpu:.0f} per CPU second")
    print(f"{'N x K':>11} {'rows':>5} {'exact GOP/s':>12} {'int8 GOP/s':>11} {'int/exact':>10} {'exact /cpu-s':>13} "
          f"{'int8 /cpu-s':>12} {'int8 % f32 peak':>16}" + (f" {args.against:>12} GOP/s  int/{args.against}"
                                                             if args.against else ""))
    run = jax.jit(functools.partial(dense, kernel=True))
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        copies = weights_in(args.format, [(n, k)] * args.copies)
        modes: dict[str, list[Any]] = {"exact": copies, "int8": [pack_int8_panels(w) for w in copies]}
        if args.against:
            applies, older = OLDER_LAYOUTS[args.against]
            if not (isinstance(copies[0], GgufBlocks) and applies(copies[0])):
                raise SystemExit(f"--against {args.against}: {args.format} is not in a layout it changes")
            modes[args.against] = [pack_int8_panels(older(jax.device_get(w))) for w in copies]
        for rows in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
            for ws in modes.values():
                seconds(run, x, ws[0])  # compile
            times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
            for round_ in range(args.rounds):
                for mode, ws in modes.items():
                    times[mode].append(seconds(run, x, ws[round_ % len(ws)]))
            ops = 2 * rows * n * k
            (e, e_cpu), (i, i_cpu), *tables = (gflops(ops, times[mode]) for mode in modes)
            also = f" {tables[0][0]:>16.0f} {i / tables[0][0]:>15.2f}x" if tables else ""
            print(f"{shape:>11} {rows:>5} {e:>12.0f} {i:>11.0f} {i / e:>9.2f}x {e_cpu:>13.0f} {i_cpu:>12.0f} "
                  f"{100 * i / peak:>15.0f}%{also}", flush=True)


if __name__ == "__main__":
    main()
