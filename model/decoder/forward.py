"""The decoder forward pass over a paged KV pool: one body for every family, reading what a
family changes (q/k norms, sandwich norms, GeGLU, embedding, residual and logit scales,
soft-caps, per-layer windows, chunks and RoPE, attention sinks and the output projection's bias,
mixture-of-experts layers: model/decoder/moe.py) from ``ModelConfig``.

It is not jitted here: the engine's programs (``workers/runner/programs.py``) and the reference loop
(``model/decoder/generate.py``) each jit it with what they add (bucketing and sampling, or nothing).

Variable sizes travel as data: each row ``b`` holds tokens at ``positions[b]``; a token is
real when ``0 <= position < context_lens[b]`` (``context_lens`` counts the row's tokens
*including* this step's), anything else is padding and writes to the null block.
Layers run in a Python loop over their own weight arrays (see model/decoder/params.py for why not
``lax.scan``); each writes its K/V into its slice of the stacked pool, which is updated in
place when the caller donates it.

A float32 model's matmuls compute in float32 on every backend (``FULL_FLOAT32``): JAX's default
lets a GPU round them to TensorFloat32 (10 mantissa bits), and on an H200 that put a float32
model's logits ~1e-2 from HF's and parted an adapter's greedy tokens from its merged model's.
The CPU computes float32 dots in float32 either way; a bfloat16 model's programs are left as
they were.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp

from raylm.model.config.model_config import AttentionSpec, ModelConfig
from raylm.model.decoder.attention import paged_attention, slot_indices, write_kv
from raylm.model.decoder.kv_pool import GroupedKV, KVCache
from raylm.model.decoder.latent_attention import latent_attention
from raylm.model.decoder.layers import (
    apply_rope,
    attention_temperature,
    gated_mlp,
    rms_norm,
    rope_cos_sin,
    rope_for,
    scaled,
)
from raylm.model.decoder.lora_slots import LayerLora, LoraBatch
from raylm.model.decoder.moe import moe_block
from raylm.model.decoder.params import LayerParams, ModelParams
from raylm.model.kernels.dense import dense
from raylm.model.kernels.paged_decode import decode_attention
from raylm.model.kernels.pallas.paged_attention import gpu_paged_attention, unsupported_reason
from raylm.model.quantization.gguf_blocks import GgufBlocks
from raylm.model.quantization.int8_panels import Int8Panels
from raylm.model.quantization.quant_array import QuantArray

FULL_FLOAT32 = "float32"  # jax.default_matmul_precision for 32-bit operands: no TF32 rounding

_Fn = TypeVar("_Fn", bound=Callable)


def _full_float32_matmuls(fn: _Fn) -> _Fn:
    """``fn(params, ...)`` traced with its matmuls in float32 when ``params`` is a float32
    model's (its norms, never quantized, hold the model dtype; module docstring: why)."""

    @functools.wraps(fn)
    def traced(params: ModelParams, *args, **kwargs):
        if params.final_norm.dtype != jnp.float32:
            return fn(params, *args, **kwargs)
        with jax.default_matmul_precision(FULL_FLOAT32):
            return fn(params, *args, **kwargs)

    return traced  # type: ignore[return-value]


@_full_float32_matmuls
def forward(
    params: ModelParams,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    kv: KVCache | GroupedKV,
    block_tables: jax.Array,
    context_lens: jax.Array,
    all_logits: bool = False,
    cpu_kernels: bool = False,
    logits_rows: jax.Array | None = None,
    pool_segments: jax.Array | None = None,
    num_pool_segments: int = 0,
    hidden_sink: HiddenSink | None = None,
    lora: LoraBatch | None = None,
    expert_load: jax.Array | None = None,
    hidden_in: jax.Array | None = None,
    hidden_out: bool = False,
    gpu_kernels: bool = False,
) -> tuple:
    """Run ``tokens [B, S]`` through the model, writing their K/V into ``kv``.

    Returns float32 logits ``[B, S, V]`` if ``all_logits`` else ``[B, V]`` for each row's
    last real token, and the updated pool. ``kv`` is one pool with ``block_tables [B, P]`` for
    every layer, or, for a model whose sliding and full-attention layers keep KV groups of
    their own, a ``GroupedKV`` with ``block_tables [2, B, P]``: layer ``i`` reads the pool and
    table of its group, ``config.kv_group(i)``. With ``cpu_kernels`` (one token per row,
    ``S == 1``)
    the C++ CPU kernels run where they apply: attention by ``decode_attention``, the paged
    kernel whose cost follows each row's real context, not the block-table width (prompt
    chunks use it packed one token per row: each token sees the keys up to its position,
    which is causal attention because the chunk's K/V are written first), and small-batch
    projections by ``model.kernels.dense``. Pass False for a program sharded over several devices
    (XLA cannot partition a custom call) to keep the jnp path. ``logits_rows [R]``
    keeps only those rows' logits (``[R, V]``): packed chunks need each chunk's last token's.

    With ``pool_segments [B, S]`` (a segment id per token, -1 for none) it also returns the
    final-normed hidden states of the tokens pooled per segment (``PooledHidden``: their sum
    over ``num_pool_segments`` segments, and each logits row's own), for embeddings.

    With ``hidden_sink`` it writes every token's hidden states, as HF's
    ``output_hidden_states`` numbers them (0: the embeddings, ``i``: the residual stream after
    layer ``i - 1``, ``L``: the final-normed output), into the sink's buffers, and returns the
    updated buffers last.

    With ``lora`` each row ``b`` adds its LoRA adapter's deltas (slot ``lora.slots[b]``, 0 for
    none) to the projections of every layer (model/decoder/lora_slots.py).

    With ``expert_load [sparse layers, E]`` (int32: tokens routed per expert of each MoE
    layer, in layer order) it adds this step's real tokens to it and returns the sum last:
    the load-balance metric accumulates on the device and the host reads it now and then.

    A pipeline stage (``params`` and ``config`` of its layers alone: ``ModelConfig.layer_slice``)
    that is not the first takes the previous stage's residual stream ``hidden_in [B, S, D]`` in
    place of ``tokens``' embeddings; one that is not the last returns with ``hidden_out`` its own
    residual stream ``[B, S, D]`` in place of logits (then the pool, then ``expert_load``'s sum).

    With ``gpu_kernels`` (a GPU replica's, sharded or not) the Pallas kernels run where the program
    is lowered for a GPU, the jnp path elsewhere: attention where the kernel reads the layer's pools and
    head size (``model.kernels.pallas.paged_attention``: decode rows and prompt chunks alike), and
    the experts' grouped matmuls (``model.kernels.pallas.grouped_matmul``).
    """
    if hidden_out and (pool_segments is not None or hidden_sink is not None):
        raise ValueError("a stage that hands its hidden states on neither pools nor captures them")
    valid = (positions >= 0) & (positions < context_lens[:, None])
    grouped = isinstance(kv, GroupedKV)
    if block_tables.ndim != (3 if grouped else 2):
        raise ValueError(f"block tables of shape {block_tables.shape} for {'grouped' if grouped else 'one'} KV pool")
    tables = tuple(block_tables) if grouped else (block_tables,)
    slots = tuple(slot_indices(positions, table, valid, kv.block_size) for table in tables)
    rotations = {False: rope_cos_sin(positions, rope_for(config))}
    if config.local_rope_theta is not None:
        rotations[True] = rope_cos_sin(positions, rope_for(config, local=True))
    if cpu_kernels and tokens.shape[1] != 1:
        raise ValueError(f"the paged kernel takes one query per row (pack prompt chunks), got {tokens.shape}")
    kernel_lens = None
    if cpu_kernels:
        # Keys each query sees (its position + 1; 0 for a padding row): the kernel's contract.
        kernel_lens = jnp.where(valid[:, 0], positions[:, 0] + 1, 0)
    batch = _Batch(positions, tables, context_lens, valid, slots, rotations, kernel_lens, gpu_kernels)
    embed = params.embed
    if hidden_in is not None:
        x = hidden_in.astype(params.final_norm.dtype)
    elif isinstance(embed, (QuantArray, GgufBlocks, Int8Panels)):
        x = embed.rows(tokens, params.final_norm.dtype)
    else:  # a float32 model's 16-bit embedding (model/loaders/hf_tensors.py): the looked-up rows widened
        x = embed[tokens].astype(params.final_norm.dtype)
    if config.embed_scale is not None and hidden_in is None:  # in the model dtype, as HF Gemma rounds it
        x = x * jnp.asarray(config.embed_scale, x.dtype)
    if config.embedding_multiplier is not None and hidden_in is None:  # float32, as HF Granite's Python float
        x = scaled(x, config.embedding_multiplier)
    eps = config.rms_norm_eps

    pools = [[group.k, group.v] for group in (kv if grouped else (kv,))]
    # Each layer's (KV group, index in that group's stacked pool).
    where = {i: (g, j) for g, layers in enumerate(config.kv_group_layers if grouped else (range(config.num_layers),))
             for j, i in enumerate(layers)}
    sink = None if hidden_sink is None else hidden_sink.write(0, x, valid)
    routed = []  # per sparse layer: tokens routed to each expert [E]
    for i, lp in enumerate(params.layers):
        g, j = where[i]
        with jax.named_scope(f"layer_{i}"):  # traces (``raylm profile``) read as layers and ops
            layer_lora = None if lora is None else LayerLora(lora.weights[i], lora.slots, cpu_kernels)
            x, pools[g][0], pools[g][1], counts = _layer(lp, config, batch, i, g, j, x, *pools[g], layer_lora)
        if counts is not None:
            routed.append(counts)
        if sink is not None and i + 1 < len(params.layers):
            sink = sink.write(i + 1, x, valid)
    if hidden_out:
        out = (x, KVCache(*pools[0]) if not grouped else GroupedKV(*(KVCache(k, v) for k, v in pools)))
        return out + ((expert_load + jnp.stack(routed),) if expert_load is not None else ())
    if sink is not None:
        with jax.named_scope("hidden_states"):
            sink = sink.write(len(params.layers), rms_norm(x, params.final_norm, eps), valid)

    sums = None
    if pool_segments is not None:
        with jax.named_scope("pooling"):
            hidden = rms_norm(x, params.final_norm, eps).astype(jnp.float32)
            ids = jnp.where(valid & (pool_segments >= 0), pool_segments, num_pool_segments).reshape(-1)
            sums = jax.ops.segment_sum(hidden.reshape(-1, hidden.shape[-1]), ids, num_pool_segments + 1)
    if not all_logits:
        last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, D]
        if logits_rows is not None:
            x = x[logits_rows]  # [R, 1, D]
    with jax.named_scope("final_norm"):
        x = rms_norm(x, params.final_norm, eps)
    if sums is not None:
        pooled = PooledHidden(sums[:num_pool_segments], x.astype(jnp.float32).reshape(x.shape[0], -1, x.shape[-1]))
    # Tied or not, the head is [V, D] and read as stored (``embed.T`` made XLA CPU copy the
    # whole matrix into a transposed buffer on every step).
    head = params.embed if params.lm_head is None else params.lm_head
    with jax.named_scope("lm_head"):
        logits = dense(x, head, kernel=cpu_kernels, out_dtype=jnp.float32)
        if config.logits_divisor is not None:
            logits = logits / config.logits_divisor
        if config.final_softcap is not None:
            logits = jnp.tanh(logits / config.final_softcap) * config.final_softcap
    if not all_logits:
        logits = logits[:, 0]
    caches = [KVCache(k, v) for k, v in pools]
    out = (logits, GroupedKV(*caches) if grouped else caches[0])
    if sums is not None:
        out += (pooled,)
    if sink is not None:
        out += (sink.buffers,)
    if expert_load is not None:
        out += (expert_load + jnp.stack(routed),)
    return out


def full_table(block_tables: jax.Array) -> jax.Array:
    """The full-attention layers' block table (``[B, P]``, of a ``[2, B, P]`` pair): the one a
    draft model reads in every layer (it shares the target's tables and the full one keeps
    every block)."""
    return block_tables if block_tables.ndim == 2 else block_tables[0]


class HiddenSink(NamedTuple):
    """Where a step writes hidden states: ``buffers [slots, L + 1, capacity, D]`` (float32), and
    for each token its request's slot (``slots [B, S]``, out of range for none) and its index
    in that slot's buffer (``index [B, S]``)."""

    buffers: jax.Array
    slots: jax.Array
    index: jax.Array

    def write(self, layer: int, x: jax.Array, valid: jax.Array) -> HiddenSink:
        """Store ``x [B, S, D]`` as entry ``layer`` of the real tokens that have a slot."""
        num_slots, _, capacity, _ = self.buffers.shape
        keep = valid & (self.index >= 0) & (self.index < capacity)  # (a negative index would wrap)
        slots = jnp.where(keep, self.slots, num_slots)  # out of range: dropped
        buffers = self.buffers.at[slots, layer, self.index].set(x.astype(self.buffers.dtype), mode="drop")
        return self._replace(buffers=buffers)


class PooledHidden(NamedTuple):
    """Final-normed hidden states for embeddings (float32)."""

    sums: jax.Array  # [num_pool_segments, D]: summed over each segment's tokens
    last: jax.Array  # [R, 1, D] (or [B, S, D] with all_logits): the logits rows' own


class _Batch(NamedTuple):
    """What every layer reads of this step's batch (computed once per step)."""

    positions: jax.Array  # [B, S]
    block_tables: tuple[jax.Array, ...]  # [B, P] per KV group (one, or the full and sliding layers')
    context_lens: jax.Array  # [B]
    valid: jax.Array  # [B, S]
    slots: tuple[tuple[jax.Array, jax.Array], ...]  # per KV group: each token's K/V block, offset [B, S]
    rotations: dict[bool, tuple[jax.Array, jax.Array]]  # local RoPE? -> cos/sin [B, S, rope_dim] each
    kernel_lens: jax.Array | None  # [B] keys each query sees when the CPU kernels run, else None
    gpu_kernels: bool  # the Pallas kernels where lowered for a GPU (attention, experts)

    @property
    def cpu_kernels(self) -> bool:
        """Whether this step runs the CPU kernels (projections too, through ``model.kernels.dense``)."""
        return self.kernel_lens is not None


def _layer(
    lp: LayerParams, config: ModelConfig, batch: _Batch, i: int, group: int, slot: int, x: jax.Array,
    k_pool: jax.Array, v_pool: jax.Array, lora: LayerLora | None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Decoder layer ``i``: attention (GQA: ``_attention``, or DeepSeek's latent attention:
    model/decoder/latent_attention.py) writing into index ``slot`` of its KV group's pool
    (``group``: which table it reads), fused MLP; with sandwich norms each block's output is
    normed before its residual add, and scaled by a residual multiplier; each projection plus its
    LoRA delta with ``lora``. Returns ``x``, both pools, and for a sparse layer the tokens routed
    to each expert (else None)."""
    eps = config.rms_norm_eps
    spec = config.attention(i)
    if config.mla is not None:
        with jax.named_scope("latent_attention"):
            attn, k_pool = latent_attention(lp, config, batch, rms_norm(x, lp.attn_norm, eps), k_pool, slot, group,
                                            spec)
    else:
        attn, k_pool, v_pool = _attention(lp, config, batch, i, group, slot, x, k_pool, v_pool, lora, spec)
    with jax.named_scope("wo"):
        out = dense(attn, lp.wo, 2, kernel=batch.cpu_kernels)
        if lp.bo is not None:
            out = out + lp.bo
        if lora is not None:
            out = lora.add("o_proj", out, attn)
        x = _residual_add(x, out, lp.post_attn_norm, config)
    with jax.named_scope("mlp"):
        h = rms_norm(x, lp.mlp_norm, eps)
        counts = None
        if config.is_sparse(i):
            out, counts = moe_block(h, lp, config.moe, config.activation, kernel=batch.cpu_kernels, valid=batch.valid,
                                    gpu_kernel=batch.gpu_kernels)
        else:
            out = gated_mlp(h, lp.w_gate_up, lp.w_down, config.activation, kernel=batch.cpu_kernels, lora=lora)
        x = _residual_add(x, out, lp.post_mlp_norm, config)
        return x, k_pool, v_pool, counts


def _attention(
    lp: LayerParams, config: ModelConfig, batch: _Batch, i: int, group: int, slot: int, x: jax.Array,
    k_pool: jax.Array, v_pool: jax.Array, lora: LayerLora | None, spec: AttentionSpec,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Layer ``i``'s GQA: fused QKV, (q/k norm), RoPE (none on a NoPE layer, whose queries may be
    temperature-scaled instead; Llama 4's L2 q/k norm after it), K/V write, attention; returns each head's
    output ``[B, S, H, Dh]`` and both pools."""
    B, S, _ = x.shape
    G = config.q_per_kv
    eps = config.rms_norm_eps
    with jax.named_scope("qkv"):
        h = rms_norm(x, lp.attn_norm, eps)
        qkv = dense(h, lp.wqkv, kernel=batch.cpu_kernels)  # [B, S, KVH, G + 2, Dh]
        if lora is not None:
            qkv = lora.add("qkv", qkv, h)
        if lp.bqkv is not None:
            qkv = qkv + lp.bqkv
        q = qkv[:, :, :, :G].reshape(B, S, config.num_heads, config.head_dim)
        k, v = qkv[:, :, :, G], qkv[:, :, :, G + 1]
        if lp.q_norm is not None:
            q, k = _qk_norm(q, lp.q_norm, config), _qk_norm(k, lp.k_norm, config)
        if config.uses_rope(i):
            cos, sin = batch.rotations[config.uses_local_rope(i)]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if config.l2_qk_norm:  # Llama 4: after RoPE, no weight
                unit = jnp.ones((), q.dtype)
                q, k = rms_norm(q, unit, eps), rms_norm(k, unit, eps)
        elif config.attn_temperature is not None:
            q = attention_temperature(q, batch.positions, config.attn_temperature)
    table, (block, offset) = batch.block_tables[group], batch.slots[group]
    with jax.named_scope("kv_write"):
        k_pool = write_kv(k_pool, slot, block, offset, k, batch.cpu_kernels)
        v_pool = write_kv(v_pool, slot, block, offset, v, batch.cpu_kernels)
    with jax.named_scope("attention"):
        if batch.cpu_kernels and spec.chunk is None:  # (the kernel has no chunked mask)
            attn = decode_attention(q[:, 0], k_pool, v_pool, slot, table, batch.kernel_lens, spec, lp.sinks)[:, None]
        elif batch.gpu_kernels and unsupported_reason(q.shape[-1], k_pool.shape[2], k_pool, v_pool, spec) is None:
            attn = gpu_paged_attention(q, k_pool, v_pool, slot, table, batch.positions, batch.context_lens,
                                       batch.valid, spec, lp.sinks)
        else:
            attn = paged_attention(q, k_pool, v_pool, slot, table, batch.positions, batch.context_lens, batch.valid,
                                   spec, lp.sinks)
    return attn, k_pool, v_pool


def _residual_add(x: jax.Array, branch: jax.Array, post_norm: jax.Array | None, config: ModelConfig) -> jax.Array:
    """``x`` plus a block's output, that output normed first with sandwich norms (Gemma 2, 3)
    and times the residual multiplier (Granite)."""
    if post_norm is not None:
        branch = rms_norm(branch, post_norm, config.rms_norm_eps)
    if config.residual_multiplier is not None:
        branch = scaled(branch, config.residual_multiplier)
    return x + branch


def _qk_norm(x: jax.Array, weight: jax.Array, config: ModelConfig) -> jax.Array:
    """RMSNorm of ``x [B, S, heads, Dh]``: over each head, or over all heads at once (OLMoE
    normalizes the whole projection; its heads are in HF's order, see model/decoder/params.py)."""
    if not config.qk_norm_whole:
        return rms_norm(x, weight, config.rms_norm_eps)
    B, S, heads, Dh = x.shape
    return rms_norm(x.reshape(B, S, heads * Dh), weight, config.rms_norm_eps).reshape(B, S, heads, Dh)
