"""Elementwise building blocks of a decoder layer: RMSNorm, rotary embeddings, gated MLPs."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from raylm.model.config.llama4 import AttnTemperature
from raylm.model.config.model_config import ModelConfig
from raylm.model.config.rope import RopeScaling
from raylm.model.decoder.lora_slots import LayerLora
from raylm.model.kernels.dense import dense
from raylm.model.kernels.fusion_barrier import materialized


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 and cast back, as HF Llama does (Gemma's ``1 + w`` weights
    are folded into ``weight`` at load)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def scaled(x: jax.Array, factor: float) -> jax.Array:
    """``x`` times a constant, multiplied in float32 and rounded to ``x``'s dtype: what torch
    does for a tensor times a Python float (Granite's multipliers)."""
    return (x.astype(jnp.float32) * np.float32(factor)).astype(x.dtype)


def attention_temperature(q: jax.Array, positions: jax.Array, temperature: AttnTemperature) -> jax.Array:
    """Llama 4's NoPE-layer queries ``q [B, S, H, Dh]`` times ``log1p(floor((p + 1) / floor_scale))
    * attn_scale + 1`` at their positions ``[B, S]``, in float32 as HF computes it."""
    p = positions.astype(jnp.float32)
    scales = jnp.log1p(jnp.floor((p + 1.0) / temperature.floor_scale)) * temperature.attn_scale + 1.0
    return (q.astype(jnp.float32) * scales[:, :, None, None]).astype(q.dtype)


class Rope(NamedTuple):
    """Per-pair inverse frequencies and the factor cos/sin are multiplied by (yarn, longrope)."""

    inv_freq: np.ndarray
    attention_factor: float = 1.0


def rope_for(config: ModelConfig, local: bool = False) -> Rope:
    """The RoPE of ``config``'s global layers, or with ``local`` of its sliding layers (their own
    base, no scaling; Gemma 3). Computed once on the host in float32, as HF's rope
    initialisation functions do, over the dims it rotates (``ModelConfig.rope_dim``)."""
    if local:
        assert config.local_rope_theta is not None
        return Rope(_default_inv_freq(config.local_rope_theta, config.rope_dim))
    return _scaled(config.rope_theta, config.rope_dim, config.rope_scaling, config.max_position_embeddings)


def _default_inv_freq(theta: float, dim: int) -> np.ndarray:
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    return (1.0 / (theta**exponents)).astype(np.float32)


def _scaled(theta: float, dim: int, scaling: RopeScaling | None, max_positions: int) -> Rope:
    inv_freq = _default_inv_freq(theta, dim)
    if scaling is None:
        return Rope(inv_freq)
    kind = scaling.rope_type
    if kind == "linear":
        return Rope((inv_freq / scaling.factor).astype(np.float32))
    if kind == "llama3":
        return Rope(_llama3(inv_freq, scaling))
    if kind == "yarn":
        return _yarn(theta, dim, scaling)
    if kind == "longrope":
        return _longrope(theta, dim, scaling, max_positions)
    raise ValueError(f"unknown rope_type {kind!r}")  # model.config.rope refuses these at load


def _llama3(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """Long wavelengths slowed by ``factor``, short ones kept, a smooth ramp between."""
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn(theta: float, dim: int, s: RopeScaling) -> Rope:
    """YaRN: interpolate the low frequencies by ``factor``, keep the high ones, ramp between
    the dims whose rotations over the original length fall between ``beta_fast`` and
    ``beta_slow``; cos/sin scaled by the attention factor."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        attention = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim) if (
            s.mscale and s.mscale_all_dim) else mscale(s.factor)
    original = s.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = (theta ** (np.arange(0, dim, 2).astype(np.float32) / dim)).astype(np.float32)
    inv_freq = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return Rope(inv_freq.astype(np.float32), float(attention))


def _longrope(theta: float, dim: int, s: RopeScaling, max_positions: int) -> Rope:
    """Phi-3's LongRoPE: a rescale factor per frequency, the long ones when the context
    (``max_positions``: the served one, see ``ModelConfig.served_at``) exceeds the original.
    That is llama.cpp's static choice; HF switches factors once a running sequence grows past
    the original length, which equals this for every sequence of a replica serving within it."""
    original = s.original_max_position_embeddings
    attention = s.attention_factor
    if attention is None:
        attention = 1.0 if s.factor <= 1.0 else math.sqrt(1 + math.log(s.factor) / math.log(original))
    factors = s.long_factor if max_positions > original else s.short_factor
    if len(factors) != dim // 2:
        raise ValueError(f"longrope has {len(factors)} factors for head_dim {dim} (needs {dim // 2})")
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    inv_freq = 1.0 / (np.asarray(factors, np.float32) * theta**exponents)
    return Rope(inv_freq.astype(np.float32), float(attention))


def rope_cos_sin(positions: jax.Array, rope: Rope) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables ``[..., rope_dim]`` for integer positions (HF's duplicated-halves layout),
    times the rope's attention factor; computed once per program, not in every layer's
    rotations (``model.kernels.fusion_barrier``)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope.inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if rope.attention_factor != 1.0:
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    return materialized(cos, sin)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [B, S, heads, Dh]`` by position (rotate-half convention, as HF Llama) over its
    first ``R`` dims, the tables' ``[B, S, R]``; the other ``Dh - R`` pass through unchanged
    (partial rotary: HF's ``apply_rotary_pos_emb`` rotates ``x[..., :R]`` by halves of R)."""
    rotary = cos.shape[-1]
    x32 = x.astype(jnp.float32)
    part, rest = x32[..., :rotary], x32[..., rotary:]
    half = rotary // 2
    rotated = jnp.concatenate([-part[..., half:], part[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = part * cos + rotated * sin
    if rest.shape[-1]:
        out = jnp.concatenate([out, rest], axis=-1)
    return out.astype(x.dtype)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def gated_mlp(
    x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, activation: str = "silu", *, kernel: bool = False,
    lora: LayerLora | None = None,
) -> jax.Array:
    """``down(act(gate(x)) * up(x))`` with gate and up as one ``[2, I, D]`` matmul: SwiGLU for
    ``silu``, GeGLU for ``gelu_tanh`` (``kernel``: see ``model.kernels.dense``); each matmul plus its
    LoRA delta with ``lora``."""
    gate_up = dense(x, w_gate_up, kernel=kernel)  # [B, S, 2, I]
    if lora is not None:
        gate_up = lora.add("gate_up", gate_up, x)
    hidden = ACTIVATIONS[activation](gate_up[:, :, 0]) * gate_up[:, :, 1]
    out = dense(hidden, w_down, kernel=kernel)
    return out if lora is None else lora.add("down_proj", out, hidden)
