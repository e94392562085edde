"""The Llama-family forward pass over a paged KV pool, and its jitted prefill/decode entry points.

Variable sizes travel as data: each row ``b`` holds tokens at ``positions[b]``; a token is
real when ``0 <= position < context_lens[b]`` (``context_lens`` counts the row's tokens
*including* this step's), anything else is padding and writes to the null block.
Layers run under ``lax.scan`` with the whole KV pool in the carry, so the pool is
updated in place when the caller donates it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from model.attention import KVCache, paged_attention, slot_indices, write_kv
from model.config import ModelConfig
from model.layers import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq, swiglu_mlp
from model.params import LayerParams, ModelParams


def forward(
    params: ModelParams,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    kv: KVCache,
    block_tables: jax.Array,
    context_lens: jax.Array,
    all_logits: bool = False,
) -> tuple[jax.Array, KVCache]:
    """Run ``tokens [B, S]`` through the model, writing their K/V into ``kv``.

    Returns float32 logits ``[B, S, V]`` if ``all_logits`` else ``[B, V]`` for each row's
    last real token, and the updated pool.
    """
    valid = (positions >= 0) & (positions < context_lens[:, None])
    block, offset = slot_indices(positions, block_tables, valid, kv.block_size)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(config))
    x = params.embed[tokens]
    eps = config.rms_norm_eps

    def layer(carry, inputs):
        x, k_pool, v_pool = carry
        lp, i = inputs
        lp: LayerParams
        h = rms_norm(x, lp.attn_norm, eps)
        q = jnp.einsum("bsd,dhk->bshk", h, lp.wq)
        k = jnp.einsum("bsd,dhk->bshk", h, lp.wk)
        v = jnp.einsum("bsd,dhk->bshk", h, lp.wv)
        if lp.bq is not None:
            q, k, v = q + lp.bq, k + lp.bk, v + lp.bv
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_pool = write_kv(k_pool, i, block, offset, k)
        v_pool = write_kv(v_pool, i, block, offset, v)
        attn = paged_attention(q, k_pool, v_pool, i, block_tables, positions, context_lens, valid)
        x = x + jnp.einsum("bshk,hkd->bsd", attn, lp.wo)
        h = rms_norm(x, lp.mlp_norm, eps)
        x = x + swiglu_mlp(h, lp.w_gate, lp.w_up, lp.w_down)
        return (x, k_pool, v_pool), None

    layer_ids = jnp.arange(config.num_layers)
    (x, k_pool, v_pool), _ = jax.lax.scan(layer, (x, kv.k, kv.v), (params.layers, layer_ids))

    if not all_logits:
        last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, D]
    x = rms_norm(x, params.final_norm, eps)
    head = params.embed.T if params.lm_head is None else params.lm_head
    logits = jnp.einsum("bsd,dv->bsv", x, head, preferred_element_type=jnp.float32)
    if not all_logits:
        logits = logits[:, 0]
    return logits, KVCache(k_pool, v_pool)


@functools.partial(jax.jit, static_argnames=("config", "all_logits"), donate_argnames=("kv",))
def prefill(
    params: ModelParams,
    kv: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    *,
    config: ModelConfig,
    all_logits: bool = False,
) -> tuple[jax.Array, KVCache]:
    """Jitted prompt (chunk) step: ``tokens [B, S]`` -> last-token logits ``[B, V]``."""
    return forward(params, config, tokens, positions, kv, block_tables, context_lens, all_logits)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("kv",))
def decode(
    params: ModelParams,
    kv: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    *,
    config: ModelConfig,
) -> tuple[jax.Array, KVCache]:
    """Jitted one-token step: ``tokens [B]`` at ``positions [B]`` -> logits ``[B, V]``."""
    logits, kv = forward(
        params, config, tokens[:, None], positions[:, None], kv, block_tables, context_lens
    )
    return logits, kv
