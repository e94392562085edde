"""The parameter pytree: dataclasses whose array fields are JAX leaves.

Each decoder layer has its own arrays (``ModelParams.layers`` is a tuple), and the forward
pass loops over them in Python. A stacked ``[L, ...]`` layout under ``lax.scan`` compiles
faster, but XLA's CPU backend then copies every layer's weights out of the stack on every
step (dynamic-slice), which measured ~1.4x slower at batch 1 (see
``deploy/benchmarks/decode_step_bench.py``).

Matrices are stored output-first with their input dims last and contiguous (HF's
``[out, in]``): each output's weights are one run of memory, which is what the CPU
small-batch matmul kernel streams (model/dense.py) and what XLA's own dot handled best
too at decode batch sizes. Q, K and V are one fused matrix and gate/up another, so a
layer runs three matmuls before attention fewer (at batch 1 each matmul is bound by reading
its weights, and the fused one reads them in one pass). The QKV columns are grouped by KV
head: KV head ``k`` owns query heads ``k*G .. k*G+G-1`` (``G = H / KVH``, as in HF's GQA),
then its key, then its value. So splitting the ``kv_heads`` axis over tensor-parallel
devices gives each device whole groups, with the query heads that read its keys.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerParams:
    """One decoder layer's weights."""

    # Matrices may be QuantArrays (model/quantization.py) of the same shape.
    attn_norm: jax.Array  # [D]
    wqkv: jax.Array  # [KVH, G + 2, Dh, D]: per KV head, its G query heads, its key, its value
    wo: jax.Array  # [D, H, Dh]
    mlp_norm: jax.Array  # [D]
    w_gate_up: jax.Array  # [2, I, D]: gate, then up
    w_down: jax.Array  # [D, I]
    bqkv: Optional[jax.Array] = None  # [KVH, G + 2, Dh] (Qwen2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelParams:
    """A whole Llama-family model. ``lm_head`` is None when tied to ``embed``."""

    embed: jax.Array  # [V, D]
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array  # [D]
    lm_head: Optional[jax.Array] = None  # [V, D], as the tied embedding


# Logical axis names of every parameter, by field. sharding.py maps them onto a mesh.
LAYER_AXES: dict[str, tuple[str, ...]] = {
    "attn_norm": ("embed",),
    "wqkv": ("kv_heads", "qkv", "head_dim", "embed"),
    "wo": ("embed", "heads", "head_dim"),
    "mlp_norm": ("embed",),
    "w_gate_up": ("gate_up", "mlp", "embed"),
    "w_down": ("embed", "mlp"),
    "bqkv": ("kv_heads", "qkv", "head_dim"),
}
MODEL_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("vocab", "embed"),
}
# Matrices (``dense`` weights, stored [out..., in...]) and how many trailing dims are inputs:
# the fields weight-only quantization replaces by a QuantArray (model/quantization.py), with
# a scale per output channel. The embedding is one too: as the tied LM head it is a [V, D]
# matrix, and its rows are the lookup's per-token scales.
LAYER_MATRIX_INPUT_DIMS: dict[str, int] = {"wqkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1}
MODEL_MATRIX_INPUT_DIMS: dict[str, int] = {"embed": 1, "lm_head": 1}
KV_POOL_AXES: tuple[str, ...] = ("layers", "blocks", "block_slot", "kv_heads", "head_dim")

