"""The worker replica as a Ray Serve deployment: one model replica and its engine per actor.

Serve gives the replica its lifecycle: it calls ``check_health`` periodically (a stuck or
broken engine fails it and gets the replica restarted), ``record_routing_stats`` for request
routers, and on scale-down stops routing here, waits up to ``graceful_shutdown_timeout_s`` for
in-flight requests, then calls ``__del__``, which aborts what is left and stops the engine.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from ray import serve

from workers.async_engine import AsyncEngine
from workers.replica_protocol import (
    GenerateChunk,
    GenerateRequest,
    InvalidRequestError,
    ReplicaDrainingError,
    chunk_from_output,
)

logger = logging.getLogger("ray.serve")

DEFAULT_STUCK_AFTER_S = 300.0  # a first compile of a large bucket can take a minute on CPU
DEFAULT_MAX_REPORTED_HASHES = 4096  # 64k tokens of prefix at block size 16; ~40 KB per report


@serve.deployment(
    name="LLMWorker",
    max_ongoing_requests=256,
    graceful_shutdown_timeout_s=30,
    health_check_period_s=10,
    health_check_timeout_s=30,
)
class LLMWorker:
    """One model replica serving ``generate`` streams."""

    def __init__(
        self,
        model: str,
        engine_args: dict[str, Any],
        stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
        max_reported_hashes: int = DEFAULT_MAX_REPORTED_HASHES,
    ):
        self.model = model
        self.max_reported_hashes = max_reported_hashes
        self.engine = AsyncEngine.from_model(model, **engine_args)
        self.stuck_after_s = stuck_after_s
        self.draining = False
        logger.info("raylm worker ready: %s, %d KV blocks", model, self.engine.engine.pool.num_usable_blocks)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream deltas; a cancelled call (client gone) aborts the request and frees its blocks."""
        if self.draining:
            raise ReplicaDrainingError("this replica is shutting down; retry")
        reported: set[int] = set()
        started = False
        try:
            async for output in self.engine.generate(
                request.prompt_token_ids, request.params, request.request_id, request.priority
            ):
                started = True
                yield chunk_from_output(output, reported)
        except ValueError as err:
            if started:
                raise
            raise InvalidRequestError(str(err)) from None

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def check_health(self) -> None:
        self.engine.check_health(self.stuck_after_s)

    async def stats(self) -> dict[str, Any]:
        """Engine counters (queue, KV pool, tokens, prefix cache)."""
        return await self.engine.stats()

    async def record_routing_stats(self) -> dict[str, Any]:
        """What request routers (and ``raylm status``) read: load, KV use, lifetime token counts,
        and the hashes of cached KV blocks (bounded) for prefix-aware routing."""

        def snapshot(engine) -> dict[str, Any]:
            return {"stats": engine.stats(), "hashes": engine.pool.cached_hashes(self.max_reported_hashes)}

        taken = await self.engine.run_in_engine(snapshot)
        stats = taken["stats"]
        return {
            "running": stats["running"],
            "waiting": stats["waiting"],
            "running_tokens": stats["tokens_stored"],
            "waiting_tokens": stats["waiting_tokens"],
            "kv_usage": stats["usage"],
            "num_used_blocks": stats["num_used_blocks"],
            "num_usable_blocks": stats["num_usable_blocks"],
            "requests": stats["requests"],
            "prompt_tokens": stats["prompt_tokens"],
            "generation_tokens": stats["generation_tokens"],
            "prefix_queries": stats["prefix_queries"],
            "prefix_hits": stats["prefix_hits"],
            "block_hashes": taken["hashes"],
        }

    async def __del__(self) -> None:
        """Serve already waited for in-flight requests; abort stragglers and stop the engine."""
        self.draining = True
        aborted = await self.engine.abort_all()
        if aborted:
            logger.warning("raylm worker shutting down: aborted %d unfinished request(s)", aborted)
        self.engine.shutdown()
