"""The dense matmul kernel of this tree against a baseline commit's, both loaded in one process.

Kernel changes of a few percent are below what separate processes can resolve on a shared
machine (its speed drifts by tens of percent between minutes). Here the baseline commit's
``dense_matmul.cc`` is compiled with the flags ``setup.py`` uses (kernel_baseline.py), loaded
with ctypes and registered as FFI targets of its own; one jitted program per build multiplies
input rows by every matrix of the bundled model kept as GGUF blocks (weights streamed from
memory, as in a decode step) through ``model.kernels.dense.gguf_matmul``, as the engine calls it, the
baseline's traced inside ``model.kernels.tracing_targets``. The programs run in alternating rounds; the outputs must be
equal bit for bit (the kernels promise the float32 expansion's sums), and the script prints
each row count's median milliseconds and the ratio baseline / this tree (above 1: this tree is
faster). Calls of more than ``KERNEL_MAX_ROWS`` rows run either build's prompt GEMM, as
``model.kernels.dense`` picks.

    python -m raylm.benchmarks.dense_kernel_ab --baseline HEAD~1 [--rows 1,16,64,512] [--rounds 11]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from raylm.benchmarks.dense_bench import _matrices, time_ms
from raylm.benchmarks.kernel_baseline import build_baseline, register_baseline, require_builds
from raylm.model.kernels import tracing_targets
from raylm.model.kernels.dense import available, gguf_matmul
from raylm.model.quantization.gguf_blocks import GgufBlocks

BASELINE_TARGET = "raylm_ab_baseline"
HANDLERS = {BASELINE_TARGET: "RaylmGgufMatmul", BASELINE_TARGET + "_prompt": "RaylmGgufMatmulPrompt"}
# This tree's targets (model.kernels.dense) traced as the baseline's inside tracing_targets.
BASELINE_TARGETS = {"raylm_gguf_matmul": BASELINE_TARGET, "raylm_gguf_matmul_prompt": BASELINE_TARGET + "_prompt"}


def program(targets: dict[str, str]) -> tuple[Callable, Callable]:
    """A jitted function multiplying per-K input rows by every matrix through
    ``model.kernels.dense.gguf_matmul``, and the same called inside ``tracing_targets(targets)``. Each
    program jits a function of its own: JAX caches traces by function, not by the mapping."""

    @jax.jit
    def run(inputs: dict[int, jax.Array], weights: list[GgufBlocks]) -> list[jax.Array]:
        return [gguf_matmul(inputs[w.shape[1]], w) for w in weights]

    def traced(inputs: dict[int, jax.Array], weights: list[GgufBlocks]) -> list[jax.Array]:
        with tracing_targets(targets):
            return run(inputs, weights)

    return run, traced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="HEAD", help="git revision to compare with (default HEAD)")
    parser.add_argument("--rows", default="1,4,9,16,32,64,128,512")
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()

    if not available():
        raise SystemExit("this tree's kernels are not built (make setup)")
    with tempfile.TemporaryDirectory(prefix="raylm-kernel-ab-") as tmp:
        register_baseline(build_baseline(args.baseline, "dense_matmul", Path(tmp)), HANDLERS)
        programs = {"baseline": program(BASELINE_TARGETS), "this tree": program({})}
        runs = {name: traced for name, (_, traced) in programs.items()}
        _, blocks = _matrices()
        rng = np.random.default_rng(0)
        print(f"baseline = {args.baseline}; GGUF-block matmuls of the bundled model, medians of {args.rounds} "
              f"alternating rounds, ms")
        print(f"{'rows':>5} {'baseline':>9} {'this tree':>10} {'ratio':>7}")
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {k: jnp.asarray(rng.standard_normal((rows, k)), jnp.float32) for k in {w.shape[1] for w in blocks}}
            base, tree = (run(inputs, blocks) for run in runs.values())
            with tracing_targets(BASELINE_TARGETS):
                lowered = programs["baseline"][0].lower(inputs, blocks).as_text()
            require_builds(lowered, programs["this tree"][0].lower(inputs, blocks).as_text(), HANDLERS)
            if not all(bool(jnp.array_equal(a, b)) for a, b in zip(base, tree)):
                raise SystemExit(f"{rows} rows: the two builds' results differ")
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, run in runs.items():
                    times[name].append(time_ms(run, inputs, blocks))
            before, after = (statistics.median(times[name]) for name in runs)
            print(f"{rows:>5} {before:>9.2f} {after:>10.2f} {before / after:>6.2f}x", flush=True)


if __name__ == "__main__":
    main()
