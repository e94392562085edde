"""gpt-oss's differences inside a mixture-of-experts block (model/config/expert_mlp.py): per-expert
biases added to the grouped matmuls' rows, and the clamped SwiGLU. Kept apart from the routing
and grouping in model/decoder/moe.py, which call these where a config asks for them."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from raylm.model.config.expert_mlp import ClampedSwiglu


def expert_rows(bias: jax.Array, experts: jax.Array) -> jax.Array:
    """``bias [E, ...]`` of each row's expert ``experts [R]``; zeros for a row routed to no
    expert (index ``E``: a padding token's, which the grouped matmul leaves at zero too)."""
    return jnp.take(bias, experts, axis=0, mode="fill", fill_value=0)


def clamped_swiglu(gate: jax.Array, up: jax.Array, swiglu: ClampedSwiglu) -> jax.Array:
    """HF GptOssExperts' ``_apply_gate``: ``(clip(up, -l, l) + 1) * g * sigmoid(alpha * g)``
    with ``g = min(gate, l)``."""
    gate = jnp.minimum(gate, swiglu.limit)
    up = jnp.clip(up, -swiglu.limit, swiglu.limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * swiglu.alpha))
