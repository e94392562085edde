"""Paged attention on a GPU, decode rows and prompt chunks alike, as a Pallas (Triton) kernel
that reads the stacked KV pool in place.

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

Prompt chunks take the same kernel with more queries per program: a block of a chunk's tokens
times a GQA group's heads is one ``dot``'s rows (flash attention over the paged pool), each row
masked causally at its own position. A decode row is a block of one token, and its pages are
split over several programs (long contexts, few rows); a chunk's blocks give the parallelism.

The contract is ``model.decoder.attention.paged_attention``'s (and, for one query per row,
``model.kernels.paged_decode.paged_decode_attention``'s); the CPU test suite runs this kernel
in Pallas interpret mode against the jnp reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from raylm.model.config.model_config import AttentionSpec
from raylm.model.decoder.attention import paged_attention
from raylm.model.decoder.kv_pool import Pool, pool_dtype
from raylm.model.kernels import gpu_kernels_interpreted, on_gpu
from raylm.model.quantization.quant_array import QUANTIZED_DTYPES, QuantArray
from raylm.model.runtime.buckets import bucket, cdiv, next_power_of_two
from raylm.model.runtime.sharding import TP_AXIS, array_mesh

FLOAT_POOL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MIN_DOT = 16  # Triton's smallest dot dimension: a program's query rows are padded up to it
CHUNK_ROWS = 64  # query rows (tokens x a group's heads) per program for prompt chunks
PAGES_PER_DOT = 8  # pages of keys per ``dot`` (128 keys at raylm's 16-token blocks)
MAX_SPLITS = 16  # partitions of a decode row's pages (flash decoding): parallelism for few, long rows
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # a hidden key's score: finite, so no inf - inf


def unsupported_reason(head_dim: int, block_size: int, k_pool: Pool, v_pool: Pool,
                       spec: AttentionSpec | None) -> str | None:
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


def _split_plan(width: int, splittable: bool) -> tuple[int, int, int]:
    """(pages per dot, partitions, padded width) for a block table ``width`` pages wide."""
    per_dot = bucket(width, 1, PAGES_PER_DOT)
    splits = max(1, min(MAX_SPLITS, width // per_dot)) if splittable else 1
    padded = cdiv(width, splits * per_dot) * splits * per_dot
    return per_dot, splits, padded


def _kernel(q_ref, k_ref, k_scale_ref, v_ref, v_scale_ref, table_ref, first_ref, end_ref, range_ref, o_ref, l_ref,
            m_ref, *, pages_per_dot: int, scale: float, softcap: float | None, exact: bool):
    """One (row, kv head, query block, partition): each query row ``r`` sees the keys in
    ``[first_ref[r], end_ref[r])`` (its window's first key to its position + 1); the block walks
    the pages of ``range_ref`` (the union of its rows' spans) that fall in this partition."""
    split = pl.program_id(3)
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    pages_per_split = table_ref.shape[0]
    keys_per_dot = pages_per_dot * page_size
    first, end = first_ref[...], end_ref[...]
    split_page = split * pages_per_split
    # This partition's pages that hold keys some row sees, relative to its first page.
    lo = jnp.maximum(range_ref[0] // page_size - split_page, 0)
    hi = jnp.minimum(pl.cdiv(range_ref[1], page_size) - split_page, pages_per_split)
    precision = jax.lax.Precision.HIGHEST if exact else None
    q = q_ref[...]

    def body(step, carry):
        o_prev, m_prev, l_prev = carry
        pages = table_ref[pl.ds(step * pages_per_dot, pages_per_dot)]
        k = k_ref[pages].reshape(keys_per_dot, head_dim)
        v = v_ref[pages].reshape(keys_per_dot, head_dim)
        logits = plgpu.dot(q, k.astype(q.dtype), trans_b=True, precision=precision)  # [rows, keys]
        if k_scale_ref is not None:  # 8-bit keys: one scale per key, across the dot's output
            logits = logits * k_scale_ref[pages].reshape(1, keys_per_dot)
        logits = logits * scale
        if softcap is not None:
            logits = jnp.tanh(logits / softcap) * softcap
        key = (split_page + step * pages_per_dot) * page_size + jnp.arange(keys_per_dot)
        visible = (key[None, :] >= first[:, None]) & (key[None, :] < end[:, None])  # [rows, keys]
        logits = jnp.where(visible, logits, MASKED)
        m_next = jnp.maximum(m_prev, logits.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        # Keys a row does not see may hold anything (the null block, a window's freed blocks,
        # another row's future): zero their weights and values, so not even a NaN there counts.
        weights = jnp.where(visible, jnp.exp(logits - m_next[:, None]), 0.0)
        l_next = l_prev * correction + weights.sum(axis=-1)
        if v_scale_ref is not None:  # 8-bit values: their scales weigh the softmax's columns
            weights = weights * v_scale_ref[pages].reshape(1, keys_per_dot)
        # (A block's rows are consecutive tokens: the keys any of them sees are its range.)
        v = jnp.where(((key >= range_ref[0]) & (key < range_ref[1]))[:, None], v.astype(q.dtype), 0)
        o_next = o_prev * correction[:, None] + plgpu.dot(weights.astype(q.dtype), v, precision=precision)
        return o_next, m_next, l_next

    o = jnp.zeros((rows, head_dim), jnp.float32)
    m = jnp.full((rows,), -jnp.inf, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    o, m, l = jax.lax.fori_loop(lo // pages_per_dot, pl.cdiv(hi, pages_per_dot), body, (o, m, l))
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


def pallas_paged_attention(
    q: jax.Array,
    k_pool: Pool,
    v_pool: Pool,
    layer: jax.Array | int,
    block_tables: jax.Array,
    positions: jax.Array,
    context_lens: jax.Array,
    valid: jax.Array,
    spec: AttentionSpec | None = None,
    sinks: jax.Array | None = None,
    *,
    interpret: bool = False,
) -> jax.Array:
    """``paged_attention``'s contract by the Pallas kernel: queries ``q [B, S, H, Dh]`` at
    ``positions [B, S]`` over pools ``[L, N, bs, KVH, Dh]`` read at ``layer`` through
    ``block_tables [B, P]``; a query sees the keys up to its position (within ``spec.window``)
    and below its row's ``context_lens``; an invalid query (``valid`` false) gets zeros.
    ``interpret`` (or ``model.kernels.interpreting_gpu_kernels``) runs it on the CPU. Computes
    in float32 (the dots in the pool's 16-bit type for 16-bit pools), returns ``q``'s dtype.
    Raises ``ValueError`` when ``unsupported_reason`` says why it cannot."""
    B, S, H, Dh = q.shape
    L, N, bs, KVH, _ = k_pool.shape
    spec = spec or AttentionSpec(Dh**-0.5)
    if reason := unsupported_reason(Dh, bs, k_pool, v_pool, spec):
        raise ValueError(f"the Pallas paged attention kernel cannot run this attention: {reason}")
    group = H // KVH
    # A program's query rows: ``tokens`` of the chunk times the group's heads (padded to ``heads``).
    heads = max(MIN_DOT, next_power_of_two(group)) if S == 1 else next_power_of_two(group)
    tokens = 1 if S == 1 else max(1, CHUNK_ROWS // heads)
    blocks = cdiv(S, tokens)
    rows = tokens * heads
    per_dot, splits, width = _split_plan(block_tables.shape[1], splittable=S == 1)
    # Layer ``layer``'s page ``p`` is row ``layer * N + p`` of the pool without its layer axis.
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, width - block_tables.shape[1])))
    tables = (tables + jnp.asarray(layer, jnp.int32) * N).reshape(B, splits, width // splits)
    pad = blocks * tokens - S
    positions = positions.astype(jnp.int32)
    end = jnp.where(valid, jnp.minimum(positions + 1, context_lens.astype(jnp.int32)[:, None]), 0)  # [B, S]
    first = jnp.maximum(positions - spec.window + 1, 0) if spec.window else jnp.zeros_like(positions)
    first, end = (jnp.pad(jnp.minimum(a, end), ((0, 0), (0, pad))).reshape(B, blocks, tokens) for a in (first, end))
    seen = end > first
    block_range = jnp.stack([jnp.where(seen, first, 1 << 30).min(-1), jnp.where(seen, end, 0).max(-1)], -1)
    first, end = (jnp.repeat(a.reshape(B, blocks * tokens), heads, axis=1) for a in (first, end))  # per row
    qg = q.reshape(B, S, KVH, group, Dh).transpose(0, 2, 1, 3, 4)  # [B, KVH, S, G, Dh]
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, pad), (0, heads - group), (0, 0))).reshape(B, KVH, blocks * rows, Dh)
    if isinstance(k_pool, QuantArray):
        compute = jnp.dtype(jnp.bfloat16) if q.dtype == jnp.bfloat16 else jnp.dtype(jnp.float32)
        k_values, k_scales = k_pool.q.reshape(L * N, bs, KVH, Dh), k_pool.scale.reshape(L * N, bs, KVH)
        v_values, v_scales = v_pool.q.reshape(L * N, bs, KVH, Dh), v_pool.scale.reshape(L * N, bs, KVH)
        scale_spec = pl.BlockSpec((L * N, bs, None), lambda b, h, i, s: (0, 0, h))
    else:
        compute = jnp.dtype(k_pool.dtype)
        k_values, v_values = k_pool.reshape(L * N, bs, KVH, Dh), v_pool.reshape(L * N, bs, KVH, Dh)
        k_scales = v_scales = scale_spec = None
    pool_spec = pl.BlockSpec((L * N, bs, None, Dh), lambda b, h, i, s: (0, 0, h, 0))
    row_spec = pl.BlockSpec((None, rows), lambda b, h, i, s: (b, i))
    kernel = functools.partial(_kernel, pages_per_dot=per_dot, scale=float(spec.scale), softcap=spec.softcap,
                               exact=compute == jnp.float32)
    partial_shape = (B, KVH, splits, blocks * rows)
    o, l, m = pl.pallas_call(
        kernel,
        grid=(B, KVH, blocks, splits),
        in_specs=[
            pl.BlockSpec((None, None, rows, Dh), lambda b, h, i, s: (b, h, i, 0)),
            pool_spec, scale_spec, pool_spec, scale_spec,
            pl.BlockSpec((None, None, width // splits), lambda b, h, i, s: (b, s, 0)),
            row_spec, row_spec,
            pl.BlockSpec((None, None, 2), lambda b, h, i, s: (b, i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, Dh), lambda b, h, i, s: (b, h, s, i, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, i, s: (b, h, s, i)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, i, s: (b, h, s, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*partial_shape, Dh), jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
        ],
        interpret=interpret or gpu_kernels_interpreted(),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="raylm_paged_attention",
    )(qg.astype(compute), k_values, k_scales, v_values, v_scales, tables, first, end, block_range)
    o, l, m = (a.reshape(B, KVH, splits, blocks * tokens, heads, *a.shape[4:])[:, :, :, :S, :group] for a in (o, l, m))
    out = _combine(o, l, m, sinks, KVH, group)  # [B, KVH, S, G, Dh]
    return out.transpose(0, 2, 1, 3, 4).reshape(B, S, H, Dh).astype(q.dtype)


def _combine(o: jax.Array, l: jax.Array, m: jax.Array, sinks: jax.Array | None, kv_heads: int,
             group: int) -> jax.Array:
    """The partitions' partial softmaxes (``o [B, KVH, splits, S, G, Dh]``, sums and maxima
    ``[B, KVH, splits, S, G]``) as one, with each head's sink logit in the denominator; a query
    that sees no key (padding) gets zeros."""
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(kv_heads, 1, group)
    top = m.max(axis=2)  # [B, KVH, S, G]
    if sink is not None:
        top = jnp.maximum(top, sink)
    safe_top = jnp.where(jnp.isfinite(top), top, 0.0)
    weight = jnp.where(jnp.isfinite(m), jnp.exp(m - safe_top[:, :, None]), 0.0)
    total = (l * weight).sum(axis=2)
    out = (o * weight[..., None]).sum(axis=2)
    seen = total > 0
    if sink is not None:
        total = total + jnp.exp(sink - safe_top)
    return jnp.where(seen[..., None], out / jnp.where(seen, total, 1.0)[..., None], 0.0)


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
    """``paged_decode_attention``'s contract (``q [B, H, Dh]``, each row's ``context_lens`` keys,
    0 for a padding row, which gets zeros) by the Pallas kernel."""
    positions = (context_lens - 1)[:, None]
    out = pallas_paged_attention(q[:, None], k_pool, v_pool, layer, block_tables, positions, context_lens,
                                 (context_lens > 0)[:, None], spec, sinks, interpret=interpret)
    return out[:, 0]


def gpu_paged_attention(
    q: jax.Array,
    k_pool: Pool,
    v_pool: Pool,
    layer: jax.Array | int,
    block_tables: jax.Array,
    positions: jax.Array,
    context_lens: jax.Array,
    valid: jax.Array,
    spec: AttentionSpec | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Paged attention by this kernel where the program is lowered for an NVIDIA GPU and by the
    jnp ``paged_attention`` elsewhere (``model.kernels.on_gpu``); the caller checked
    ``unsupported_reason``. Invalid queries get zeros on both.

    Under tensor parallelism (the pools' mesh, read from their type, has a ``tp`` axis over
    several devices) each device runs the kernel on its own KV heads and their query heads, a
    ``shard_map`` over ``tp`` (XLA cannot partition the kernel); where ``tp`` does not divide the
    KV heads (they are replicated) attention takes the jnp path."""
    # ``sinks`` last and only when given: a shard_map takes arrays, and splits them over heads.
    args = (q, k_pool, v_pool, jnp.asarray(layer, jnp.int32), block_tables, positions, context_lens, valid,
            *(() if sinks is None else (sinks,)))

    def reference(q, k_pool, v_pool, layer, block_tables, positions, context_lens, valid, sinks=None):
        out = paged_attention(q, k_pool, v_pool, layer, block_tables, positions, context_lens, valid, spec, sinks)
        return jnp.where(valid[:, :, None, None], out, 0)

    def kernel(q, k_pool, v_pool, layer, block_tables, positions, context_lens, valid, sinks=None):
        return pallas_paged_attention(q, k_pool, v_pool, layer, block_tables, positions, context_lens, valid, spec,
                                      sinks)
    mesh = array_mesh(k_pool, TP_AXIS)
    if mesh is not None:
        if k_pool.shape[3] % mesh.shape[TP_AXIS]:
            return reference(*args)
        split = lambda leaf, axis: P(*(TP_AXIS if i == axis else None for i in range(leaf.ndim)))  # noqa: E731
        pool = jax.tree.map(lambda leaf: split(leaf, 3), k_pool)
        in_specs = (split(q, 2), pool, pool, P(), P(), P(), P(), P(), *(() if sinks is None else (P(TP_AXIS),)))
        # (check_vma off: a pallas_call's outputs carry no varying-axes types to check)
        kernel = jax.shard_map(kernel, mesh=mesh, in_specs=in_specs, out_specs=split(q, 2), check_vma=False)
    return on_gpu(*args, gpu=kernel, default=reference)
