"""KV blocks beyond the replica's pool: the connector the engine talks to (``connector``), the
tiers behind it (host memory, local disk; the cluster tier lives in ``raylm.cluster``, on Ray),
the payload layout of one block (``block_layout``) and the keys blocks are stored under
(``identity``)."""

from raylm.cache.offload.block_layout import BlockLayout
from raylm.cache.offload.config import KVOffloadConfig
from raylm.cache.offload.connector import KVConnector
from raylm.cache.offload.disk_tier import DiskTier
from raylm.cache.offload.host_tier import HostTier
from raylm.cache.offload.identity import group_namespace, namespace, tier_key, tier_keys
from raylm.cache.offload.tier import TIER_NAMES, KVTier, TierKey, TierStats

__all__ = [
    "TIER_NAMES", "BlockLayout", "DiskTier", "HostTier", "KVConnector", "KVOffloadConfig", "KVTier", "TierKey",
    "TierStats", "group_namespace", "namespace", "tier_key", "tier_keys",
]
