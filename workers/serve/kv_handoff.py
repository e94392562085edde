"""A worker replica's part in prefill/decode disaggregation: the two waits around the KV handoff.

A prefill replica answers a ``publish_kv`` request only once every block it computed is in the
KV tiers (the decode replica looks for them there next); a decode replica serving a
``refresh_kv`` request first syncs its view of the cluster tier, so its scheduler finds the
blocks just published. Both run the engine's thread-safe hooks off the event loop, bounded by a
timeout. Neither ever fails the request: a handoff that fails or times out costs the decode
replica a recompute of the blocks it cannot find, never a wrong or missing answer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger("ray.serve")


async def publish_computed_kv(llm_engine: Any, timeout_s: float, request_id: str) -> bool:
    """Wait until every block ``llm_engine`` computed so far is written to its tiers
    (``LLMEngine.flush_kv_publish``); False, logged, when that failed or took over ``timeout_s``."""
    return await _bounded(llm_engine, "flush_kv_publish", timeout_s, f"publishing the KV of request {request_id}")


async def refresh_kv_mirror(llm_engine: Any, timeout_s: float, request_id: str) -> bool:
    """Sync ``llm_engine``'s mirror of the cluster tier now (``LLMEngine.refresh_kv_tiers``); False,
    logged, when that failed or took over ``timeout_s``."""
    return await _bounded(llm_engine, "refresh_kv_tiers", timeout_s, f"refreshing the KV tiers for {request_id}")


async def _bounded(llm_engine: Any, hook: str, timeout_s: float, what: str) -> bool:
    # The hook gets the timeout itself; the outer wait (a little longer) also bounds a hook that
    # ignores it. A thread still running past it is left to finish on its own.
    try:
        await asyncio.wait_for(asyncio.to_thread(getattr(llm_engine, hook), timeout_s), timeout_s + 1.0)
        return True
    except Exception as err:  # a tier's failure costs a recompute, never the request
        logger.warning("%s failed (%r); the decode replica computes what it cannot load", what, err)
        return False
