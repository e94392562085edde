"""Which kernels a replica's programs run: the C++ CPU kernels, the Pallas attention kernel on a
GPU, or neither (the portable jnp path). Chosen once per runner from its platform, mesh and
pools; the programs take the answer as a static flag, so each choice compiles its own code."""

from __future__ import annotations

import logging

import jax
from jax.sharding import Mesh

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.kv_pool import GroupedKV, KVCache
from raylm.model.kernels import paged_decode
from raylm.model.kernels.pallas import paged_attention as pallas_attention
from raylm.model.runtime.sharding import TP_AXIS

logger = logging.getLogger(__name__)

GPU_ATTENTION_CHOICES = ("pallas", "jnp")


def cpu_kernels_run(mesh: Mesh, kv: KVCache | GroupedKV) -> bool:
    """Whether the programs run the C++ CPU kernels (``forward``'s ``cpu_kernels``): the paged
    attention kernel built, a CPU backend, an unsharded replica (XLA cannot partition a custom
    call) and a pool dtype it reads. Projections then take the small-batch matmul kernel
    where it applies (``model.kernels.dense`` falls back to XLA's dot by itself)."""
    return (
        paged_decode.available()
        and jax.default_backend() == "cpu"
        and mesh.devices.size == 1
        and kv.dtype in paged_decode.SUPPORTED_POOL_DTYPES
    )


def gpu_kernels_run(mesh: Mesh, kv: KVCache | GroupedKV, config: ModelConfig, gpu_attention: str) -> bool:
    """Whether the programs run the Pallas kernels (``forward``'s ``gpu_kernels``): asked for
    (``gpu_attention``, "pallas" by default) on a GPU backend. A sharded replica runs them per
    device (attention over its KV heads, experts over its own under expert parallelism). Layers
    whose attention the kernel cannot read (latent attention, head sizes and pools of
    ``unsupported_reason``, chunked layers, KV heads replicated because the tensor-parallel size
    does not divide them) take the jnp path; one log line says which and why."""
    if gpu_attention not in GPU_ATTENTION_CHOICES:
        raise ValueError(f"gpu_attention must be one of {GPU_ATTENTION_CHOICES}, got {gpu_attention!r}")
    if gpu_attention != "pallas" or jax.default_backend() != "gpu":
        return False
    pools = (kv.full, kv.sliding) if isinstance(kv, GroupedKV) else (kv,)
    reasons = ["latent attention"] if config.mla is not None else [
        r for pool in pools if (r := pallas_attention.unsupported_reason(config.head_dim, kv.block_size, pool.k,
                                                                          pool.v, None))]
    tp = mesh.shape.get(TP_AXIS, 1)
    if config.num_kv_heads % tp:
        reasons.append(f"tensor_parallel_size {tp} does not divide the {config.num_kv_heads} KV heads (replicated)")
    if reasons:
        logger.info("attention takes the jnp path on this GPU: %s", "; ".join(reasons))
    return True
