"""Prefill/decode disaggregation, the router's part: a request's prompt is computed on a prefill
replica before a decode replica streams its output (Ray Serve LLM's ``build_pd_openai_app``).

The prefill hop sends the prompt as a prompt-only request (one greedy token, its output
discarded) marked ``publish_kv``: the prefill replica answers once the prompt's blocks are in the
cluster tier. The request then goes to a decode replica marked ``refresh_kv``: it syncs its view
of the cluster tier, loads the prompt's full blocks instead of computing them and streams, so the
client's stream and usage come from the decode replica alone.

A prefill that fails (its replica died, refused for load, erred) or takes longer than the
timeout falls back to the decode replica computing the prompt itself: slower, the same tokens.
Only a request the prefill replica refused as invalid ends here (a decode replica would refuse it
too). A client that goes away during the hop cancels the prefill call (the replica aborts it and
frees its blocks) and the decode call is never made.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from raylm.cluster.metrics import RouterMetrics
from raylm.router.errors import OpenAIError
from raylm.router.worker_calls import worker_stream
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.wire.replica_protocol import GenerateRequest

logger = logging.getLogger("ray.serve")

# A prefill computes the prompt and samples one token nobody reads: greedy, nothing else asked.
PREFILL_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def prefill_request(request: GenerateRequest) -> GenerateRequest:
    """The prompt-only request of ``request``'s prefill hop (same id, prompt, priority, adapter and
    block hashes, so prefix-aware routing among the prefill replicas still applies)."""
    return dataclasses.replace(request, params=PREFILL_PARAMS, beam=None, embed=False, publish_kv=True,
                               refresh_kv=False)


class PrefillHop:
    """Runs each request's prefill on the prefill deployment, then says what to send to a decode replica."""

    def __init__(self, prefill_worker: Any, timeout_s: float, metrics: RouterMetrics):
        if not timeout_s > 0:
            raise ValueError(f"the prefill timeout must be > 0 seconds, got {timeout_s!r}")
        self.prefill_worker = prefill_worker
        self.timeout_s = timeout_s
        self.metrics = metrics

    @staticmethod
    def applies_to(request: GenerateRequest) -> bool:
        """Embeddings have no decode: they go to a decode replica as they are."""
        return not request.embed

    async def decode_request(self, request: GenerateRequest) -> GenerateRequest:
        """Prefill ``request``'s prompt; the request for a decode replica: marked to load the
        published blocks, or as it came (computing its prompt) when the prefill failed.
        Raises the prefill replica's 400 when it refused the request as invalid."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._prefill(prefill_request(request))
        except TimeoutError:
            reason = "timeout"
        except OpenAIError as err:
            if err.status < 500:
                raise
            reason = "overloaded" if err.status == 503 else "error"
        else:
            self.metrics.prefill_seconds(time.monotonic() - started)
            return dataclasses.replace(request, refresh_kv=True)
        self.metrics.pd_fallback(reason)
        logger.warning("request %s: prefill failed (%s after %.1f s); a decode replica computes its prompt",
                       request.request_id, reason, time.monotonic() - started)
        return request

    async def _prefill(self, request: GenerateRequest) -> None:
        """The prefill call to its end; closing the stream on the way out (a timeout, a
        cancellation) cancels the call."""
        async with contextlib.aclosing(worker_stream(self.prefill_worker, request)) as chunks:
            async for _ in chunks:
                pass
