"""The LoRA kernel alone: one decode step's 120 adapter calls on the bundled model, per slot type.

Random adapters of rank ``--ranks`` on all seven projections of every layer are packed as a
replica packs its slots (model/decoder/lora_slots.py, ``--slots`` buffers), and one jitted program
runs model/kernels/lora_delta.py's kernel for every layer's four groups of targets (fused QKV, output,
fused gate/up, down) one after another, each call's input depending on the previous call's
result as in a real step (independent calls would let XLA run two at once). Rows use slots
1, 2, ... in turn, so ``rows`` rows read min(rows, slots) adapters. Reported per slot type and
row count, medians of alternating rounds:

- ``step ms``: the 120 calls; ``fixed ms``: the same calls with no row using a slot (what a step
  pays for passing the slots at all);
- ``adapter GB/s``: the adapters' bytes read per step over (step - fixed): how close the kernel
  comes to streaming its weights from memory. float32 slots, four times the bytes, show this
  machine's rate for the same access pattern in the same run.

Back-to-back steps leave an adapter that fits the last-level cache in it (a rank-64 int8 one is
20 MB); ``--evict-mb`` reads a larger buffer before each timed step, so each starts from memory.
A decode step lies between the two: the base weights pass through the cache between two steps'
LoRA calls.

This is what the single-stream LoRA overhead of ``lora_bench`` is made of, without the base model.

    python -m raylm.benchmarks.lora_kernel_bench [--ranks 8,64] [--rows 1,2,16] [--dtypes float32,bfloat16,int8]
        [--evict-mb 96]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from raylm.model.config.model_config import ModelConfig
from raylm.model.config.registry import DEFAULT_MODEL
from raylm.model.decoder.lora_slots import (
    GROUPS,
    LayerLora,
    LayerSlots,
    PackedLoraWeights,
    lora_shapes,
    pack_lora_weights,
)
from raylm.model.decoder.params import LAYER_INFO
from raylm.model.kernels.lora_delta import available
from raylm.model.loaders.load import load_model
from raylm.model.loaders.lora_adapter import TARGETS


def packed_slots(config: ModelConfig, slots: int, rank: int, dtype: str, seed: int = 0) -> PackedLoraWeights:
    """``slots`` random adapters of ``rank`` packed as slots of ``dtype`` (float32, bfloat16, int8)."""
    rng = np.random.default_rng(seed)
    layers = []
    for layer in range(config.num_layers):
        shapes = lora_shapes(config, layer, slots, rank)
        layers.append(LayerSlots(
            {g: (rng.standard_normal(s) * 0.01).astype(np.float32) for g, s in shapes.a.items()},
            {t: (rng.standard_normal(s) * 0.01).astype(np.float32) for t, s in shapes.b.items()}))
    packed = pack_lora_weights(layers, dtype=jnp.int8 if dtype == "int8" else None)
    buffer = jnp.asarray(packed.buffer, jnp.bfloat16 if dtype == "bfloat16" else None)
    return PackedLoraWeights(buffer, jnp.asarray(packed.scales), packed.layouts)


# Each group's fused weight (model/decoder/params.py): its output dims are the base result model.decoder.forward
# adds the group's deltas to (LayerLora.add reads QKV's KV heads from it).
_GROUP_WEIGHT = {"qkv": "wqkv", "o_proj": "wo", "gate_up": "w_gate_up", "down_proj": "w_down"}


def _fused_shape(config: ModelConfig, group: str) -> tuple[int, ...]:
    info = LAYER_INFO[_GROUP_WEIGHT[group]]
    return info.shape(config)[: -info.input_dims]


def input_width(config: ModelConfig, group: str) -> int:
    """The width of the input ``group``'s targets share."""
    return int(np.prod(TARGETS[GROUPS[group][0]].in_shape(config)))


def step_calls(config: ModelConfig, packed: PackedLoraWeights):
    """A jitted function of (inputs by width, slots, buffer, scales) adding every layer's deltas
    in order through ``LayerLora.add``, as ``model.decoder.forward`` does."""

    def run(inputs: dict[int, jax.Array], slots: jax.Array, buffer: jax.Array, scales: jax.Array) -> jax.Array:
        weights = PackedLoraWeights(buffer, scales, packed.layouts)
        last = None
        for layer in range(len(weights)):
            lora = LayerLora(weights[layer], slots, kernel=True)
            for group in GROUPS:
                x = inputs[input_width(config, group)][:, None]  # [rows, 1, K]: one decode token each
                if last is not None:  # this call waits for the previous one, as in a step
                    x = x + 0.0 * last.reshape(-1)[0]
                last = lora.add(group, jnp.zeros((*x.shape[:2], *_fused_shape(config, group)), jnp.float32), x)
        return last

    return jax.jit(run)


def _round_ms(fn, args: tuple, reps: int = 10, evict: np.ndarray | None = None) -> float:
    """Mean ms of ``reps`` back-to-back calls (one round); with ``evict``, each call timed alone
    after reading that buffer (untimed), which leaves the adapters out of the caches."""
    if evict is None:
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        out.block_until_ready()
        return (time.perf_counter() - start) / reps * 1e3
    total = 0.0
    for _ in range(reps):
        evict.sum()
        start = time.perf_counter()
        fn(*args).block_until_ready()
        total += time.perf_counter() - start
    return total / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="8,64")
    parser.add_argument("--rows", default="1,2,16")
    parser.add_argument("--dtypes", default="float32,bfloat16,int8")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--evict-mb", type=int, default=0,
                        help="read a buffer of this many MB before each timed step, so the adapters start out of "
                             "the caches (a rank-64 int8 adapter, 20 MB, fits a 32 MB L3; 0: back-to-back steps)")
    args = parser.parse_args()
    if not available():
        raise SystemExit("the LoRA kernel is not built (pip install -e .)")
    config = load_model(DEFAULT_MODEL, "float32", keep_blocks=True).config
    rng = np.random.default_rng(1)
    widths = {input_width(config, group) for group in GROUPS}
    evict = np.ones(args.evict_mb << 18, np.float32) if args.evict_mb else None
    print(f"{DEFAULT_MODEL}: {config.num_layers} layers x 4 LoRA calls, {args.slots} slots, all seven projections")
    print(f"{'rank':>4} {'slot type':>9} {'rows':>4} {'step ms':>8} {'fixed ms':>8} {'adapter MB':>10} {'adapter GB/s':>12}")
    for rank in (int(r) for r in args.ranks.split(",")):
        for dtype in args.dtypes.split(","):
            packed = packed_slots(config, args.slots, rank, dtype)
            per_slot = packed.buffer.shape[1] * packed.buffer.dtype.itemsize + packed.scales.shape[1] * 4
            fn = step_calls(config, packed)
            for rows in (int(r) for r in args.rows.split(",")):
                inputs = {w: jnp.asarray(rng.standard_normal((rows, w)), jnp.float32) for w in widths}
                used = jnp.asarray(np.arange(rows) % args.slots + 1, jnp.int32)
                unused = jnp.zeros((rows,), jnp.int32)
                cases = [(inputs, used, packed.buffer, packed.scales), (inputs, unused, packed.buffer, packed.scales)]
                for case in cases:
                    fn(*case).block_until_ready()  # compile, first touch
                step, fixed = [], []
                for _ in range(args.rounds):  # alternating, so drift hits both alike
                    step.append(_round_ms(fn, cases[0], evict=evict))
                    fixed.append(_round_ms(fn, cases[1], evict=evict))
                step_ms, fixed_ms = statistics.median(step), statistics.median(fixed)
                megabytes = min(rows, args.slots) * per_slot / 1e6
                rate = megabytes / max(step_ms - fixed_ms, 1e-6)  # MB per ms = GB/s
                print(f"{rank:>4} {dtype:>9} {rows:>4} {step_ms:8.2f} {fixed_ms:8.2f} {megabytes:10.1f} {rate:12.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
