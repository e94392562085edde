"""Building a replica's KV connector: its tiers from ``EngineArgs.kv_offload``, and the
namespace its blocks are stored under.

The namespace (``cache.offload.identity``) is what makes a block loaded from a tier hold
exactly the bits this replica would compute: the prefix-cache salt (model name, dtype,
quantization, arithmetic mode), the weights themselves (``weights_fingerprint``: two
checkpoints served under one name never share blocks), the KV pool's element type and block
size, the pool layout (a draft model's pools included), the device count and kernel path
(they change the sums' order). LoRA adapters are in every block's hash already.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np

from raylm.cache.offload.config import KVOffloadConfig
from raylm.cache.offload.connector import KVConnector
from raylm.cache.offload.host_tier import HostTier
from raylm.cache.offload.identity import namespace
from raylm.cache.offload.tier import KVTier
from raylm.workers.runner.pool_blocks import PoolBlocks

SAMPLES_PER_ARRAY = 4096  # values of each weight array the fingerprint reads


def weights_fingerprint(params: Any) -> str:
    """A digest of the weights: every array's shape, type and an even sample of its values (of
    its first shard, so no array is gathered). Reading a few thousand values per array takes
    milliseconds for any model size and tells apart any two checkpoints that differ in more than a
    handful of values."""
    h = hashlib.blake2b(digest_size=16)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        h.update(jax.tree_util.keystr(path).encode())
        if not hasattr(leaf, "shape"):
            h.update(repr(leaf).encode())
            continue
        h.update(f"{leaf.dtype}{list(leaf.shape)}".encode())
        data = leaf.addressable_shards[0].data if isinstance(leaf, jax.Array) else leaf
        flat = np.asarray(data).reshape(-1)
        if flat.size:
            h.update(np.ascontiguousarray(flat[:: max(1, flat.size // SAMPLES_PER_ARRAY)]).view(np.uint8).tobytes())
    return h.hexdigest()


def make_tiers(config: KVOffloadConfig) -> list[KVTier]:
    """The tiers ``config`` turns on, nearest first (the order loads try them)."""
    tiers: list[KVTier] = []
    if config.host_bytes:
        tiers.append(HostTier(config.host_bytes))
    if config.disk_bytes:
        from raylm.cache.offload.disk_tier import DiskTier

        tiers.append(DiskTier(config.disk_path, config.disk_bytes))
    if config.cluster_bytes:
        from raylm.cluster.kv_cluster_tier import ClusterTier  # Ray: only where the cluster tier is on

        tiers.append(ClusterTier(config.cluster_bytes, config.load_timeout_s))
    return tiers


def make_connector(config: KVOffloadConfig, blocks: PoolBlocks, cache_salt: str, params: Any,
                   num_devices: int, cpu_kernels: bool) -> KVConnector:
    """The connector of a replica whose pools ``blocks`` reads and writes."""
    # (a model whose sliding layers keep a KV group of their own: both groups' layouts; the
    # connector keys the sliding group's blocks apart)
    signature = "|sliding=".join(layout.signature for layout in blocks.layouts)
    space = namespace(
        cache_salt, f"weights={weights_fingerprint(params)}", f"layout={signature}",
        f"block_size={blocks.runner.block_size}", f"devices={num_devices}", f"cpu_kernels={cpu_kernels}",
    )
    return KVConnector(make_tiers(config), space, *(layout.nbytes for layout in blocks.layouts))
