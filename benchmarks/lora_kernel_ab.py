"""The LoRA kernel of this tree against a baseline commit's, both loaded in one process.

The baseline commit's ``lora_delta.cc`` is compiled with ``setup.py``'s flags
(kernel_baseline.py) and registered as an FFI target of its own; ``lora_kernel_bench``'s decode
step (the bundled model's 120 adapter calls, each after the previous) is traced once per build,
the baseline's inside ``model.kernels.tracing_targets``. Per row count (rows use slots 1, 2,
... of ``--slots`` in turn) the two programs must give the same bits (the kernel's sums do not
depend on how a call is cut into work items), then run in rounds of back-to-back steps, the
order alternating; the script prints the median milliseconds per step, and the median and range
of the rounds' ratios baseline / this tree (above 1: this tree is faster; the same build on both
sides shows the machine's noise). Separate processes could not tell a 10% change on a shared
machine: two runs of the same comparison gave opposite signs.

    python -m raylm.benchmarks.lora_kernel_ab --baseline HEAD~1 [--rank 64] [--rows 1,2,16]
        [--dtype int8] [--rounds 21]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from raylm.benchmarks.kernel_baseline import build_baseline, register_baseline, require_builds
from raylm.benchmarks.lora_kernel_bench import _round_ms, input_width, packed_slots, step_calls
from raylm.model.config.registry import DEFAULT_MODEL
from raylm.model.decoder.lora_slots import GROUPS
from raylm.model.kernels import tracing_targets
from raylm.model.kernels.lora_delta import available
from raylm.model.loaders.load import load_model

BASELINE_TARGET = "raylm_lora_ab_baseline"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="HEAD", help="git revision to compare with (default HEAD)")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--rows", default="1,2,16")
    parser.add_argument("--dtype", default="int8", choices=("float32", "bfloat16", "int8"))
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()

    if not available():
        raise SystemExit("this tree's kernels are not built (make setup)")
    config = load_model(DEFAULT_MODEL, "float32", keep_blocks=True).config
    packed = packed_slots(config, args.slots, args.rank, args.dtype)
    with tempfile.TemporaryDirectory(prefix="raylm-lora-ab-") as tmp:
        register_baseline(build_baseline(args.baseline, "lora_delta", Path(tmp)), {BASELINE_TARGET: "RaylmLoraAdd"})
    builds = {"baseline": step_calls(config, packed), "this tree": step_calls(config, packed)}
    rng = np.random.default_rng(1)
    widths = {input_width(config, group) for group in GROUPS}
    print(f"baseline = {args.baseline}; the bundled model's 120 LoRA calls of a decode step, rank {args.rank}, "
          f"{args.dtype} slots, {args.slots} slots; medians of {args.rounds} alternating rounds, ms per step")
    print(f"{'rows':>5} {'baseline':>9} {'this tree':>10} {'ratio':>7} {'rounds':>11}")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {w: jnp.asarray(rng.standard_normal((rows, w)), jnp.float32) for w in widths}
        step = (inputs, jnp.asarray(np.arange(rows) % args.slots + 1, jnp.int32), packed.buffer, packed.scales)
        with tracing_targets({"raylm_lora_add": BASELINE_TARGET}):
            lowered = builds["baseline"].lower(*step).as_text()
            before = np.asarray(builds["baseline"](*step))  # traced (and compiled) here
        require_builds(lowered, builds["this tree"].lower(*step).as_text(), [BASELINE_TARGET])
        if not np.array_equal(before, np.asarray(builds["this tree"](*step))):
            raise SystemExit(f"{rows} rows: the two builds' results differ")
        times: dict[str, list[float]] = {name: [] for name in builds}
        for round_ in range(args.rounds):
            for name in list(builds)[:: 1 if round_ % 2 == 0 else -1]:
                times[name].append(_round_ms(builds[name], step))
        ratios = [b / t for b, t in zip(times["baseline"], times["this tree"])]
        print(f"{rows:>5} {statistics.median(times['baseline']):>9.3f} {statistics.median(times['this tree']):>10.3f} "
              f"{statistics.median(ratios):>6.2f}x {min(ratios):>5.2f}-{max(ratios):.2f}", flush=True)


if __name__ == "__main__":
    main()
