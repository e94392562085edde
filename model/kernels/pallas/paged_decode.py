"""Paged attention of one query per row on a GPU, as a Pallas (Triton) kernel that reads the
stacked KV pool in place.

JAX's own ``jax.experimental.pallas.ops.gpu.paged_attention`` is the model: the same
split-K flash decoding (each program walks a partition of the row's pages, a few pages per
``dot``, keeping a running max and sum; the partitions are combined after), the same
one-program-per-(row, kv head) grouping that serves every query head of a GQA group with one
read of its keys. It cannot be called as it is: it takes one layer's pages as
``[kv_heads, pages, page_size, head_dim]``, and raylm's pool is ``[layers, pages, page_size,
kv_heads, head_dim]`` for every layer at once (the layout the C++ CPU kernel, the KV writes,
offload and KV transfer share), so calling it would copy the layer's whole pool every step.
This kernel indexes the pool where it lies (layer ``l``'s page ``p`` is row ``l * pages + p``
of the pool flattened over its first two axes, a free reshape; the kv head is a strided
block), and adds what raylm's models need and JAX's kernel lacks: the attention scale,
sliding windows (a row reads only the pages its window touches), soft-caps, gpt-oss's
per-head sink logits, and 8-bit (int8 / fp8) pools with a scale per token and kv head.

The contract is ``model.kernels.paged_decode.paged_decode_attention``'s; the CPU test suite
runs this kernel in Pallas interpret mode against the jnp reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from raylm.model.config.model_config import AttentionSpec
from raylm.model.decoder.kv_pool import Pool, pool_dtype
from raylm.model.kernels import gpu_kernels_interpreted, on_gpu
from raylm.model.kernels.paged_decode import reference_decode_attention
from raylm.model.quantization.quant_array import QUANTIZED_DTYPES, QuantArray

FLOAT_POOL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MIN_DOT = 16  # Triton's smallest dot dimension: query heads of a group are padded up to it
PAGES_PER_DOT = 8  # pages of keys per ``dot`` (128 keys at raylm's 16-token blocks)
MAX_SPLITS = 16  # partitions of a row's pages (flash decoding): parallelism for few, long rows


def unsupported_reason(head_dim: int, block_size: int, k_pool: Pool, v_pool: Pool, spec: AttentionSpec | None) -> str | None:
    """Why the kernel cannot take this attention (``None`` if it can): Triton's blocks are
    powers of two, at least 16 wide on a ``dot``'s dimensions."""
    if head_dim < MIN_DOT or head_dim & (head_dim - 1):
        return f"head size {head_dim} is not a power of two of at least {MIN_DOT}"
    if block_size & (block_size - 1):
        return f"block size {block_size} is not a power of two"
    kinds = {(pool_dtype(p), isinstance(p, QuantArray)) for p in (k_pool, v_pool)}
    if len(kinds) != 1:
        return f"K and V pools differ ({kinds})"
    dtype, quantized = kinds.pop()
    if dtype not in (QUANTIZED_DTYPES if quantized else FLOAT_POOL_DTYPES):
        return f"pool dtype {dtype} is not one the kernel reads"
    if spec is not None and spec.chunk is not None:
        return "chunked attention (Llama 4's local layers) has no mask in the kernel"
    return None


def _split_plan(width: int) -> tuple[int, int, int]:
    """(pages per dot, partitions, padded width) for a block table ``width`` pages wide."""
    per_dot = min(PAGES_PER_DOT, 1 << (width - 1).bit_length())
    splits = max(1, min(MAX_SPLITS, width // per_dot))
    padded = -(-width // (splits * per_dot)) * splits * per_dot
    return per_dot, splits, padded


def _kernel(q_ref, k_ref, k_scale_ref, v_ref, v_scale_ref, table_ref, span_ref, o_ref, l_ref, m_ref, *,
            pages_per_dot: int, scale: float, softcap: float | None, exact: bool):
    """One (row, kv head, head block, partition): the row's keys in ``[span_ref[0], span_ref[1])``
    (its window's first key to its context length) that fall in this partition's pages."""
    split = pl.program_id(2)
    heads, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    pages_per_split = table_ref.shape[0]
    keys_per_dot = pages_per_dot * page_size
    first_key, end_key = span_ref[0], span_ref[1]
    split_page = split * pages_per_split
    # This partition's pages that hold visible keys, relative to its first page.
    lo = jnp.maximum(first_key // page_size - split_page, 0)
    hi = jnp.minimum(pl.cdiv(end_key, page_size) - split_page, pages_per_split)
    precision = jax.lax.Precision.HIGHEST if exact else None
    q = q_ref[...]

    def body(step, carry):
        o_prev, m_prev, l_prev = carry
        pages = table_ref[pl.ds(step * pages_per_dot, pages_per_dot)]
        k = k_ref[pages].reshape(keys_per_dot, head_dim)
        v = v_ref[pages].reshape(keys_per_dot, head_dim)
        logits = plgpu.dot(q, k.astype(q.dtype), trans_b=True, precision=precision)  # [heads, keys]
        if k_scale_ref is not None:  # 8-bit keys: one scale per key, across the dot's output
            logits = logits * k_scale_ref[pages].reshape(1, keys_per_dot)
        logits = logits * scale
        if softcap is not None:
            logits = jnp.tanh(logits / softcap) * softcap
        key = (split_page + step * pages_per_dot) * page_size + jnp.arange(keys_per_dot)
        visible = (key >= first_key) & (key < end_key)
        logits = jnp.where(visible[None, :], logits, -jnp.inf)
        m_next = jnp.maximum(m_prev, logits.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        weights = jnp.exp(logits - m_next[:, None])
        l_next = l_prev * correction + weights.sum(axis=-1)
        if v_scale_ref is not None:  # 8-bit values: their scales weigh the softmax's columns
            weights = weights * v_scale_ref[pages].reshape(1, keys_per_dot)
        # Keys outside the span may be anything (the null block, a window's freed blocks): zero
        # their weights and values, so not even a NaN there reaches the sum.
        weights = jnp.where(visible[None, :], weights, 0.0)
        v = jnp.where(visible[:, None], v.astype(q.dtype), 0)
        o_next = o_prev * correction[:, None] + plgpu.dot(weights.astype(q.dtype), v, precision=precision)
        return o_next, m_next, l_next

    o = jnp.zeros((heads, head_dim), jnp.float32)
    m = jnp.full((heads,), -jnp.inf, jnp.float32)
    l = jnp.zeros((heads,), jnp.float32)
    o, m, l = jax.lax.fori_loop(lo // pages_per_dot, pl.cdiv(hi, pages_per_dot), body, (o, m, l))
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


def pallas_paged_decode_attention(
    q: jax.Array,
    k_pool: Pool,
    v_pool: Pool,
    layer: jax.Array | int,
    block_tables: jax.Array,
    context_lens: jax.Array,
    spec: AttentionSpec | None = None,
    sinks: jax.Array | None = None,
    *,
    interpret: bool = False,
) -> jax.Array:
    """``paged_decode_attention``'s contract (``q [B, H, Dh]``, pools ``[L, N, bs, KVH, Dh]``
    read at ``layer``, ``context_lens`` keys per row through ``block_tables [B, P]``, 0 for a
    padding row, which gets zeros) by the Pallas kernel; ``interpret`` (or ``model.kernels.
    interpreting_gpu_kernels``) runs it on the CPU.
    Computes in float32 (the dots in the pool's 16-bit type for 16-bit pools), returns ``q``'s
    dtype. Raises ``ValueError`` when ``unsupported_reason`` says why it cannot."""
    B, H, Dh = q.shape
    L, N, bs, KVH, _ = k_pool.shape
    spec = spec or AttentionSpec(Dh**-0.5)
    if reason := unsupported_reason(Dh, bs, k_pool, v_pool, spec):
        raise ValueError(f"the Pallas paged decode kernel cannot run this attention: {reason}")
    group = H // KVH
    heads = max(MIN_DOT, 1 << (group - 1).bit_length())
    per_dot, splits, width = _split_plan(block_tables.shape[1])
    # Layer ``layer``'s page ``p`` is row ``layer * N + p`` of the pool without its layer axis.
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, width - block_tables.shape[1])))
    tables = (tables + jnp.asarray(layer, jnp.int32) * N).reshape(B, splits, width // splits)
    lens = context_lens.astype(jnp.int32)
    first = lens - spec.window if spec.window else jnp.zeros_like(lens)
    spans = jnp.stack([jnp.maximum(first, 0), lens], axis=1)  # [B, 2]: keys [first, end) are visible
    qg = jnp.pad(q.reshape(B, KVH, group, Dh), ((0, 0), (0, 0), (0, heads - group), (0, 0)))
    if isinstance(k_pool, QuantArray):
        compute = jnp.dtype(jnp.bfloat16) if q.dtype == jnp.bfloat16 else jnp.dtype(jnp.float32)
        k_values, k_scales = k_pool.q.reshape(L * N, bs, KVH, Dh), k_pool.scale.reshape(L * N, bs, KVH)
        v_values, v_scales = v_pool.q.reshape(L * N, bs, KVH, Dh), v_pool.scale.reshape(L * N, bs, KVH)
        scale_spec = pl.BlockSpec((L * N, bs, None), lambda b, h, s: (0, 0, h))
    else:
        compute = jnp.dtype(k_pool.dtype)
        k_values, v_values = k_pool.reshape(L * N, bs, KVH, Dh), v_pool.reshape(L * N, bs, KVH, Dh)
        k_scales = v_scales = scale_spec = None
    pool_spec = pl.BlockSpec((L * N, bs, None, Dh), lambda b, h, s: (0, 0, h, 0))
    kernel = functools.partial(_kernel, pages_per_dot=per_dot, scale=float(spec.scale), softcap=spec.softcap,
                               exact=compute == jnp.float32)
    partial_shape = (B, KVH, splits, heads)
    o, l, m = pl.pallas_call(
        kernel,
        grid=(B, KVH, splits),
        in_specs=[
            pl.BlockSpec((None, None, heads, Dh), lambda b, h, s: (b, h, 0, 0)),
            pool_spec, scale_spec, pool_spec, scale_spec,
            pl.BlockSpec((None, None, width // splits), lambda b, h, s: (b, s, 0)),
            pl.BlockSpec((None, 2), lambda b, h, s: (b, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, heads, Dh), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, heads), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, heads), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*partial_shape, Dh), jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
        ],
        interpret=interpret or gpu_kernels_interpreted(),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="raylm_paged_decode_attention",
    )(qg.astype(compute), k_values, k_scales, v_values, v_scales, tables, spans)
    out = _combine(o[:, :, :, :group], l[:, :, :, :group], m[:, :, :, :group], sinks, KVH, group)
    return out.reshape(B, H, Dh).astype(q.dtype)


def _combine(o: jax.Array, l: jax.Array, m: jax.Array, sinks: jax.Array | None, kv_heads: int,
             group: int) -> jax.Array:
    """The partitions' partial softmaxes (``o [B, KVH, S, G, Dh]``, sums and maxima ``[B, KVH,
    S, G]``) as one, with each head's sink logit in the denominator; a row with no visible key
    (padding) gets zeros."""
    top = m.max(axis=2)  # [B, KVH, G]
    if sinks is not None:
        top = jnp.maximum(top, sinks.astype(jnp.float32).reshape(kv_heads, group))
    safe_top = jnp.where(jnp.isfinite(top), top, 0.0)
    weight = jnp.where(jnp.isfinite(m), jnp.exp(m - safe_top[:, :, None]), 0.0)  # [B, KVH, S, G]
    total = (l * weight).sum(axis=2)
    if sinks is not None:
        total = total + jnp.exp(sinks.astype(jnp.float32).reshape(kv_heads, group) - safe_top)
    out = (o * weight[..., None]).sum(axis=2)
    return jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


def gpu_decode_attention(
    q: jax.Array,
    k_pool: Pool,
    v_pool: Pool,
    layer: jax.Array | int,
    block_tables: jax.Array,
    context_lens: jax.Array,
    spec: AttentionSpec | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Decode attention by this kernel where the program is lowered for an NVIDIA GPU and by
    the jnp reference elsewhere (``model.kernels.on_gpu``); the caller checked
    ``unsupported_reason``."""
    kernel = functools.partial(pallas_paged_decode_attention, spec=spec, sinks=sinks)
    reference = functools.partial(reference_decode_attention, spec=spec, sinks=sinks)
    return on_gpu(q, k_pool, v_pool, layer, block_tables, context_lens, gpu=kernel, default=reference)
