"""Paged attention of one query per row through a C++ CPU kernel (``jax.ffi``), with the jnp
path as fallback. A row is a decode token, or one token of a prompt chunk packed one token per
row (the runner's packed prefill): each row sees its own context, so "decode" in the names
means one query per row, not decode steps only.

XLA's CPU backend runs ``model.decoder.attention.paged_attention`` by gathering each row's whole
bucketed block-table width, copying it to a dot-friendly layout and softmaxing over the
padding, so decode attention costs the bucket, not the context. The kernel in
``model/kernels/paged_decode_attention.cc`` walks only each row's real blocks and reads K/V
in place from the pool. It is built by ``pip install`` (setup.py) when a C++ compiler is
there; without it, ``available()`` is False, one warning says why, and ``decode_attention``
runs the jnp reference instead. Under tensor parallelism call it per shard (``shard_map``
over the kv-head axis): XLA cannot partition a custom call by itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from raylm.model.config.model_config import AttentionSpec
from raylm.model.decoder.attention import paged_attention
from raylm.model.decoder.kv_pool import Pool, pool_dtype
from raylm.model.kernels import CpuKernel, on_cpu
from raylm.model.quantization.quant_array import QUANTIZED_DTYPES, QuantArray

_KERNEL = CpuKernel("paged_decode_attention", "RaylmPagedDecodeAttention", "raylm_paged_decode_attention")
_QUANTIZED_KERNEL = CpuKernel(
    "quantized_paged_decode_attention", "RaylmQuantizedPagedDecodeAttention", "raylm_quantized_paged_decode_attention"
)
SUPPORTED_POOL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), *QUANTIZED_DTYPES)


def available() -> bool:
    """Whether the C++ kernel is built and registered with JAX (CPU only)."""
    return _KERNEL.available() and _QUANTIZED_KERNEL.available()


def _kernel_reads(k_pool: Pool, v_pool: Pool) -> bool:
    """Both pools of one kind the kernel reads (float32 / bfloat16, or 8-bit with scales)."""
    return (
        pool_dtype(k_pool) in SUPPORTED_POOL_DTYPES
        and pool_dtype(k_pool) == pool_dtype(v_pool)
        and isinstance(k_pool, QuantArray) == isinstance(v_pool, QuantArray)
    )


def paged_decode_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    block_tables: jax.Array,
    context_lens: jax.Array,
    spec: AttentionSpec | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """One query per row ``q [B, H, Dh]`` (a decode token or a packed prompt token) over its
    paged keys, by the C++ kernel.

    ``k_pool``/``v_pool`` are ``[L, num_blocks, block_size, KVH, Dh]`` (float32 or bfloat16,
    or QuantArrays of 8-bit values with per (token, kv head) scales; read in place at
    ``layer``); row ``b`` sees its first ``context_lens[b]`` keys through
    ``block_tables [B, P]`` (for a decode token at position ``p``: ``p + 1``; 0 for a padding
    row, which gets zeros). ``spec`` (scale, sliding window, soft-cap; default plain
    ``Dh ** -0.5`` causal attention) as in ``paged_attention``; a windowed row reads only the
    blocks its window touches, so the table entries before them may be the null block.
    ``sinks [H]`` (gpt-oss): each head's sink logit joins its softmax's denominator.
    Computes in float32, returns ``[B, H, Dh]`` in ``q``'s dtype. Raises if the kernel is
    unavailable or the pool dtype unsupported; ``decode_attention`` falls back instead.
    """
    _KERNEL.require()
    if not _kernel_reads(k_pool, v_pool):
        raise ValueError(
            "paged decode attention kernel takes float32 or bfloat16 pools or 8-bit pools with scales, got "
            f"k {pool_dtype(k_pool)} and v {pool_dtype(v_pool)}; use decode_attention() to fall back to the "
            "jnp path"
        )
    no_sinks = jnp.zeros((0,), jnp.float32)  # the kernel's "none"
    rest = (jnp.asarray(layer, jnp.int32).reshape(()), block_tables.astype(jnp.int32), context_lens.astype(jnp.int32),
            no_sinks if sinks is None else sinks.astype(jnp.float32))
    spec = spec or AttentionSpec(q.shape[-1] ** -0.5)
    if spec.chunk is not None:
        raise ValueError("the paged decode kernel has no chunked-attention mask; chunked layers take paged_attention")
    attributes = dict(  # 0 means none for the kernel
        scale=np.float32(spec.scale), softcap=np.float32(spec.softcap or 0), window=np.int64(spec.window or 0)
    )
    out_type = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    if isinstance(k_pool, QuantArray):
        _QUANTIZED_KERNEL.require()
        call = jax.ffi.ffi_call(_QUANTIZED_KERNEL.target, out_type)
        out = call(q.astype(jnp.float32), k_pool.q, k_pool.scale, v_pool.q, v_pool.scale, *rest, **attributes)
    else:
        call = jax.ffi.ffi_call(_KERNEL.target, out_type)
        out = call(q.astype(jnp.float32), k_pool, v_pool, *rest, **attributes)
    return out.astype(q.dtype)


def reference_decode_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    block_tables: jax.Array,
    context_lens: jax.Array,
    spec: AttentionSpec | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """The same contract as ``paged_decode_attention``, by the portable jnp ``paged_attention``."""
    valid = (context_lens > 0)[:, None]
    positions = (context_lens - 1)[:, None]
    out = paged_attention(q[:, None], k_pool, v_pool, layer, block_tables, positions, context_lens, valid, spec,
                          sinks)
    return jnp.where(valid[:, :, None], out[:, 0], 0).astype(q.dtype)


def decode_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    block_tables: jax.Array,
    context_lens: jax.Array,
    spec: AttentionSpec | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Decode attention by the kernel when it can run here (CPU, built, dtype), else by jnp.

    With an accelerator present the platform is chosen when the program is lowered
    (``model.kernels.on_cpu``), so the same traced function also lowers for GPU/TPU (to the jnp path). ``spec``
    and ``sinks``: see ``paged_attention``.
    """
    args = (q, k_pool, v_pool, layer, block_tables, context_lens)
    reference = functools.partial(reference_decode_attention, spec=spec, sinks=sinks)
    if not available() or not _kernel_reads(k_pool, v_pool):
        return reference(*args)
    kernel = functools.partial(paged_decode_attention, spec=spec, sinks=sinks)
    return on_cpu(*args, cpu=kernel, default=reference)
