"""The parameter pytree: dataclasses whose array fields are JAX leaves.

Per-layer weights are stacked along a leading ``layers`` axis so the forward pass runs
them under one ``lax.scan`` (compile time independent of depth). Matrices are stored
in the orientation the einsums consume (input dim first), split by head where the
attention math wants heads, so no transpose happens at run time.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from model.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerParams:
    """All decoder layers' weights, each with a leading ``num_layers`` axis."""

    attn_norm: jax.Array  # [L, D]
    wq: jax.Array  # [L, D, H, Dh]
    wk: jax.Array  # [L, D, KVH, Dh]
    wv: jax.Array  # [L, D, KVH, Dh]
    wo: jax.Array  # [L, H, Dh, D]
    mlp_norm: jax.Array  # [L, D]
    w_gate: jax.Array  # [L, D, I]
    w_up: jax.Array  # [L, D, I]
    w_down: jax.Array  # [L, I, D]
    bq: Optional[jax.Array] = None  # [L, H, Dh] (Qwen2)
    bk: Optional[jax.Array] = None  # [L, KVH, Dh]
    bv: Optional[jax.Array] = None  # [L, KVH, Dh]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelParams:
    """A whole Llama-family model. ``lm_head`` is None when tied to ``embed``."""

    embed: jax.Array  # [V, D]
    layers: LayerParams
    final_norm: jax.Array  # [D]
    lm_head: Optional[jax.Array] = None  # [D, V]


# Logical axis names of every parameter, by field. sharding.py maps them onto a mesh.
LAYER_AXES: dict[str, tuple[str, ...]] = {
    "attn_norm": ("layers", "embed"),
    "wq": ("layers", "embed", "heads", "head_dim"),
    "wk": ("layers", "embed", "kv_heads", "head_dim"),
    "wv": ("layers", "embed", "kv_heads", "head_dim"),
    "wo": ("layers", "heads", "head_dim", "embed"),
    "mlp_norm": ("layers", "embed"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
    "bq": ("layers", "heads", "head_dim"),
    "bk": ("layers", "kv_heads", "head_dim"),
    "bv": ("layers", "kv_heads", "head_dim"),
}
MODEL_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
}
KV_POOL_AXES: tuple[str, ...] = ("layers", "blocks", "block_slot", "kv_heads", "head_dim")


def expected_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of each stacked layer field for ``config`` (used to validate checkpoints)."""
    L, D, H, KVH = config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads
    Dh, I = config.head_dim, config.intermediate_size
    shapes = {
        "attn_norm": (L, D),
        "wq": (L, D, H, Dh),
        "wk": (L, D, KVH, Dh),
        "wv": (L, D, KVH, Dh),
        "wo": (L, H, Dh, D),
        "mlp_norm": (L, D),
        "w_gate": (L, D, I),
        "w_up": (L, D, I),
        "w_down": (L, I, D),
    }
    if config.attention_bias:
        shapes.update(bq=(L, H, Dh), bk=(L, KVH, Dh), bv=(L, KVH, Dh))
    return shapes
