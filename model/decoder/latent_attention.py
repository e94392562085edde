"""DeepSeek's multi-head latent attention (MLA) over a paged pool of latents.

The pool keeps, per token and layer, one vector: the RMS-normed latent (``kv_lora_rank``) and
the rotated key shared by all heads (``qk_rope_head_dim``), as one "KV head"
(model/decoder/kv_pool.py). Attention reads it in one of two forms, equal up to rounding:

- expanded (prompt chunks): gather each row's latents through its block table (earlier chunks
  and prefix-cache hits included), expand them by ``kv_b_proj`` into every head's non-rotary key
  and value, and attend as multi-head attention with head size ``qk_nope + qk_rope`` (values
  ``v_head_dim``): cheaper when many queries share the expansion;
- absorbed (one query per row: decode, and prompt tokens the CPU kernels pack one per row):
  project each head's non-rotary query into the latent space by ``kv_b_proj``'s key part, attend
  as MQA with one KV head of size ``kv_lora_rank + qk_rope`` whose values are the first
  ``kv_lora_rank`` dims of its keys, and project each head's latent output back by the value
  part. The paged kernel (model/kernels/paged_decode.py) reads the latent pool in place for this:
  it is passed as both K and V (a value of all ``kv_lora_rank + qk_rope`` dims, of which the
  first ``kv_lora_rank`` are kept).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from raylm.model.config.latent_attention import LATENT_NORM_EPS
from raylm.model.config.model_config import AttentionSpec, ModelConfig
from raylm.model.decoder.attention import gather_blocks, gathered_attention, paged_attention, write_kv
from raylm.model.decoder.kv_pool import Pool
from raylm.model.decoder.layers import apply_rope, rms_norm
from raylm.model.decoder.params import LayerParams
from raylm.model.kernels.dense import dense
from raylm.model.kernels.paged_decode import decode_attention
from raylm.model.quantization.quant_array import QuantArray

if TYPE_CHECKING:
    from raylm.model.decoder.forward import _Batch


def latent_attention(
    lp: LayerParams, config: ModelConfig, batch: _Batch, h: jax.Array, pool: Pool, layer: int, group: int,
    spec: AttentionSpec,
) -> tuple[jax.Array, Pool]:
    """Attention of the normed hidden states ``h [B, S, D]`` of layer ``layer`` (its index in the
    pool of KV group ``group``): writes their latents into ``pool`` and returns each head's
    output ``[B, S, H, v_head_dim]`` (``o_proj``'s input) and the pool; in the absorbed form for
    one token per row, else in the expanded form (module docstring)."""
    mla = config.mla
    kernel = batch.cpu_kernels
    q = _query(lp, h, kernel)  # [B, S, H, nope + rope]
    q_nope, q_rot = q[..., : mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim:]
    compressed = dense(h, lp.wkv_a, kernel=kernel)  # [B, S, R + rope]
    latent = rms_norm(compressed[..., : mla.kv_lora_rank], lp.kv_a_norm, LATENT_NORM_EPS)
    k_rot = compressed[..., mla.kv_lora_rank:][:, :, None]  # [B, S, 1, rope]
    if mla.rope_interleave:
        q_rot, k_rot = _pairs_to_halves(q_rot), _pairs_to_halves(k_rot)
    cos, sin = batch.rotations[False]
    q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot, cos, sin)
    table, (block, offset) = batch.block_tables[group], batch.slots[group]
    pool = write_kv(pool, layer, block, offset, jnp.concatenate([latent[:, :, None], k_rot], axis=-1), kernel)
    if h.shape[1] == 1:
        return _absorbed(lp, config, batch, q_nope, q_rot, pool, layer, table, spec), pool
    return _expanded(lp, config, batch, q_nope, q_rot, pool, layer, table, spec), pool


def _query(lp: LayerParams, h: jax.Array, kernel: bool) -> jax.Array:
    """Each head's query: ``q_proj(h)``, or ``q_b_proj(norm(q_a_proj(h)))`` with a q LoRA rank."""
    if lp.wq is not None:
        return dense(h, lp.wq, kernel=kernel)
    low_rank = rms_norm(dense(h, lp.wq_a, kernel=kernel), lp.q_a_norm, LATENT_NORM_EPS)
    return dense(low_rank, lp.wq_b, kernel=kernel)


def _pairs_to_halves(x: jax.Array) -> jax.Array:
    """Rotary dims stored as pairs ``(x0, x1), (x2, x3), ...`` reordered to halves
    ``(x0, x2, ..., x1, x3, ...)``, where rotate-half turns each pair by its frequency: HF's
    ``apply_rotary_pos_emb_interleave`` (V3) exactly, and V2's complex rotation up to that same
    reordering of the query's and key's rotary dims, which their dot products do not see."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _float(w: jax.Array | QuantArray, dtype: jnp.dtype) -> jax.Array:
    """A matrix the absorbed form contracts per head (not a ``dense`` product), as floats."""
    return w.dequantize(dtype) if isinstance(w, QuantArray) else w.astype(dtype)


def _absorbed(
    lp: LayerParams, config: ModelConfig, batch: _Batch, q_nope: jax.Array, q_rot: jax.Array, pool: Pool,
    layer: int, table: jax.Array, spec: AttentionSpec,
) -> jax.Array:
    """MQA of ``[q_nope . W_uk, q_rot]`` over the latent pool, each head's latent output times W_uv."""
    mla = config.mla
    w_kv_b = _float(lp.wkv_b, q_nope.dtype)  # [H, nope + v, R]
    w_uk, w_uv = w_kv_b[:, : mla.qk_nope_head_dim], w_kv_b[:, mla.qk_nope_head_dim:]
    q_latent = jnp.einsum("bshn,hnr->bshr", q_nope, w_uk)
    q = jnp.concatenate([q_latent, q_rot.astype(q_latent.dtype)], axis=-1)  # [B, S, H, R + rope]
    if batch.kernel_lens is not None:  # the pool is both keys and values (module docstring)
        out = decode_attention(q[:, 0], pool, pool, layer, table, batch.kernel_lens, spec)[:, None]
    else:
        out = paged_attention(q, pool, pool, layer, table, batch.positions, batch.context_lens, batch.valid, spec)
    return jnp.einsum("bshr,hvr->bshv", out[..., : mla.kv_lora_rank], w_uv)


def _expanded(
    lp: LayerParams, config: ModelConfig, batch: _Batch, q_nope: jax.Array, q_rot: jax.Array, pool: Pool,
    layer: int, table: jax.Array, spec: AttentionSpec,
) -> jax.Array:
    """Multi-head attention over keys and values expanded by ``kv_b_proj`` from each row's latents."""
    mla = config.mla
    entries = gather_blocks(pool, layer, table, q_nope.dtype)  # [B, P, bs, 1, R + rope]
    entries = entries.reshape(table.shape[0], -1, mla.latent_dim)  # [B, T, R + rope]: key t at position t
    kv = dense(entries[..., : mla.kv_lora_rank], lp.wkv_b, kernel=batch.cpu_kernels)  # [B, T, H, nope + v]
    k_rot = jnp.broadcast_to(entries[:, :, None, mla.kv_lora_rank:], (*kv.shape[:3], mla.qk_rope_head_dim))
    keys = jnp.concatenate([kv[..., : mla.qk_nope_head_dim], k_rot.astype(kv.dtype)], axis=-1)
    q = jnp.concatenate([q_nope, q_rot.astype(q_nope.dtype)], axis=-1)
    return gathered_attention(q, keys, kv[..., mla.qk_nope_head_dim:], batch.positions, batch.context_lens,
                              batch.valid, spec)
