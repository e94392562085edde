"""Paged attention, portable jnp path: scatter new K/V into the pool, gather through block tables.

The pool's layout (``[layers, num_blocks, block_size, kv_heads, head_dim]``, block 0 the null
block, 8-bit pools with a scale per token and kv head) is declared in ``kv_pool``. K/V are
quantized when written and dequantized when read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from raylm.model.config.model_config import AttentionSpec
from raylm.model.decoder.kv_pool import Pool
from raylm.model.kernels import kv_write
from raylm.model.quantization.quant_array import QuantArray, quantize

# Finite stand-in for -inf so fully masked (padding) rows give a defined softmax, not NaN.
_MASKED = -1e30


def slot_indices(
    positions: jax.Array, block_tables: jax.Array, valid: jax.Array, block_size: int
) -> tuple[jax.Array, jax.Array]:
    """Physical (block, offset) where each token's K/V goes; padding goes to the null block."""
    logical_block = jnp.clip(positions // block_size, 0, block_tables.shape[1] - 1)
    block = jnp.take_along_axis(block_tables, logical_block, axis=1)
    block = jnp.where(valid, block, 0)
    offset = jnp.where(valid, positions % block_size, 0)
    return block, offset


def write_kv(
    pool: Pool, layer: jax.Array | int, block: jax.Array, offset: jax.Array, values: jax.Array, cpu_kernel: bool = False
) -> Pool:
    """Scatter ``values [B, S, KVH, Dh]`` into ``pool[layer, block, offset]`` in place
    (quantized per token and kv head first, for an 8-bit pool). With ``cpu_kernel`` (a CPU
    program on one device), element types XLA's CPU scatter would upcast, rewriting the
    whole pool, are written by ``model.kernels.kv_write``'s kernel."""
    if isinstance(pool, QuantArray):
        quantized = quantize(values, pool.scheme, 1)
        return QuantArray(
            _store(pool.q, layer, block, offset, quantized.q, cpu_kernel),
            pool.scale.at[layer, block, offset].set(quantized.scale),
        )
    return _store(pool, layer, block, offset, values.astype(pool.dtype), cpu_kernel)


def copy_blocks(pool: Pool, src: jax.Array, dst: jax.Array, cpu_kernel: bool = False) -> Pool:
    """``pool`` with blocks ``src [n]`` copied to ``dst [n]`` in every layer (an 8-bit pool's
    scales with its values); every source is read before any block is written. With
    ``cpu_kernel``, as in ``write_kv``."""

    def copy(array: jax.Array) -> jax.Array:
        if not (cpu_kernel and kv_write.wanted(array)):
            return array.at[:, dst].set(array[:, src])
        block_size = array.shape[2]
        block = jnp.repeat(dst, block_size)
        offset = jnp.tile(jnp.arange(block_size, dtype=jnp.int32), dst.shape[0])
        for layer in range(array.shape[0]):  # layers are disjoint: each reads its sources first
            array = kv_write.kv_write(array, layer, block, offset, array[layer, src])
        return array

    return jax.tree.map(copy, pool)


def _store(array: jax.Array, layer: jax.Array | int, block: jax.Array, offset: jax.Array, values: jax.Array,
           cpu_kernel: bool) -> jax.Array:
    if cpu_kernel and kv_write.wanted(array):
        return kv_write.kv_write(array, layer, block, offset, values)
    return array.at[layer, block, offset].set(values)


def gather_blocks(pool: Pool, layer: jax.Array, block_tables: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``pool[layer, block_tables]`` (``[B, P, block_size, KVH, Dh]``), dequantized to ``dtype``
    for an 8-bit pool (one gather of the values and one of the scales, no layer-slice copy)."""
    if isinstance(pool, QuantArray):
        return pool.rows((layer, block_tables), dtype)
    return pool[layer, block_tables]


def paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
    context_lens: jax.Array,
    valid: jax.Array,
    spec: AttentionSpec | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal GQA attention of queries ``q [B, S, H, Dh]`` over each row's cached keys.

    A query at position ``p`` sees the keys at positions ``0..p`` of its own row (which
    includes the K/V just written for this step), only ``p - window + 1..p`` for a sliding
    ``spec.window``, only those from ``p``'s ``spec.chunk`` start on for a chunked layer;
    scores are ``q.k * spec.scale`` (default ``Dh ** -0.5``), soft-capped by ``spec.softcap``
    (``cap * tanh(s / cap)``) before the mask. With ``sinks [H]`` each head's sink logit joins
    its softmax's denominator (``softmax_with_sinks``). Returns ``[B, S, H, Dh]``.
    """
    k = gather_blocks(k_pool, layer, block_tables, q.dtype)  # [B, P, bs, KVH, Dh]
    v = gather_blocks(v_pool, layer, block_tables, q.dtype)
    B, P, bs = k.shape[:3]
    return gathered_attention(q, k.reshape(B, P * bs, *k.shape[3:]), v.reshape(B, P * bs, *v.shape[3:]), positions,
                              context_lens, valid, spec, sinks)


def gathered_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    context_lens: jax.Array,
    valid: jax.Array,
    spec: AttentionSpec | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """``paged_attention`` over keys and values already gathered in position order: key ``t``
    of row ``b`` is ``k[b, t]`` (``[B, T, KVH, Dk]``, values ``[B, T, KVH, Dv]``: a head size of
    their own, as DeepSeek's expanded latent attention has). Returns ``[B, S, H, Dv]``."""
    B, S, H, Dh = q.shape
    spec = spec or AttentionSpec(Dh**-0.5)
    T, KVH, Dv = k.shape[1], k.shape[2], v.shape[-1]
    # (batch, kv_head) leading, keys next: XLA CPU's batched dot is ~8x faster on this layout
    # than on the gathered one, which is worth one transposing copy.
    k = k.transpose(0, 2, 1, 3)  # [B, KVH, T, Dk]
    v = v.transpose(0, 2, 1, 3)
    qg = q.reshape(B, S, KVH, H // KVH, Dh).transpose(0, 2, 3, 1, 4).reshape(B, KVH, -1, Dh)  # [B,KVH,G*S,Dh]

    scores = jnp.einsum("bkqd,bktd->bkqt", qg, k, preferred_element_type=jnp.float32)
    scores = scores.reshape(B, KVH, H // KVH, S, T) * spec.scale
    if spec.softcap is not None:
        scores = jnp.tanh(scores / spec.softcap) * spec.softcap
    key_pos = jnp.arange(T)
    mask = (
        (key_pos[None, None, :] <= positions[:, :, None])
        & (key_pos[None, None, :] < context_lens[:, None, None])
        & valid[:, :, None]
    )  # [B, S, T]
    if spec.window is not None:
        mask &= key_pos[None, None, :] > positions[:, :, None] - spec.window
    if spec.chunk is not None:  # Llama 4's chunked layers: keys from the query's chunk start on
        mask &= key_pos[None, None, :] >= positions[:, :, None] - positions[:, :, None] % spec.chunk
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        probs = softmax_with_sinks(scores, sinks.reshape(1, KVH, H // KVH, 1, 1))
    probs = probs.astype(v.dtype).reshape(B, KVH, -1, T)
    out = jnp.einsum("bkqt,bktd->bkqd", probs, v, preferred_element_type=jnp.float32)
    out = out.reshape(B, KVH, H // KVH, S, Dv).transpose(0, 3, 1, 2, 4)
    return out.reshape(B, S, H, Dv).astype(q.dtype)


def softmax_with_sinks(scores: jax.Array, sinks: jax.Array) -> jax.Array:
    """Softmax over the last axis of float32 ``scores`` with one more logit per row, ``sinks``
    (broadcast against ``scores`` with a last axis of 1), that takes probability but carries
    no value: ``exp(s) / (sum exp(s) + exp(sink))``, as HF's gpt-oss appends the sink to the
    scores and drops its column after the softmax. Shifted by the larger of the scores' and
    the sink's maximum, so neither overflows."""
    sinks = sinks.astype(jnp.float32)
    top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sinks)
    weights = jnp.exp(scores - top)
    return weights / (jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(sinks - top))
