"""Elementwise building blocks of a Llama layer: RMSNorm, rotary embeddings, SwiGLU."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.dense import dense


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 and cast back, as HF Llama does."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies, with ``linear`` or ``llama3`` scaling applied.

    Computed once on the host in float32, following HF's rope initialisation functions.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    inv_freq = inv_freq.astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables ``[..., head_dim]`` for integer positions (HF's duplicated-halves layout)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [B, S, heads, Dh]`` by position (rotate-half convention, as HF Llama)."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return (x32 * cos + rotated * sin).astype(x.dtype)


def swiglu_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, *, kernel: bool = False) -> jax.Array:
    """``down(silu(gate(x)) * up(x))`` with gate and up as one ``[2, I, D]`` matmul
    (``kernel``: see ``model.dense``)."""
    gate_up = dense(x, w_gate_up, kernel=kernel)  # [B, S, 2, I]
    return dense(jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], w_down, kernel=kernel)
