"""The ingress deployment: one router replica of the OpenAI HTTP API in front of the workers.

The API itself is ``OpenAIService`` (plain ASGI, testable without Serve); this deployment
gives it a worker handle (and the prefill deployment's, when prefill is disaggregated), the
model's tokenizer, the cluster's record of LoRA adapters loaded over HTTP, and a poller that
follows the worker replicas' routing stats for admission capacity (and the adapters other
router replicas loaded or unloaded). Capacity follows the workers alone: beside prefill
replicas they decode, and every request holds a slot on one of them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette

from raylm.cluster.adapter_store import RayAdapterStore
from raylm.cluster.names import ROUTER_DEPLOYMENT, WORKER_DEPLOYMENT
from raylm.cluster.replicas import ReplicaStatsPoller
from raylm.cluster.response_store import RayResponseStore
from raylm.model.config.model_info import load_model_info
from raylm.router.openai_service import OpenAIService
from raylm.router.settings import RouterSettings

logger = logging.getLogger("ray.serve")


@serve.deployment(name=ROUTER_DEPLOYMENT, max_ongoing_requests=4096)
@serve.ingress()
class OpenAIRouter:
    """The OpenAI HTTP API of ``OpenAIService`` (completions, chat, responses, embeddings, models, vLLM's
    tokenize, detokenize and LoRA adapter loading, health)."""

    async def __init__(self, worker: DeploymentHandle, settings: RouterSettings,
                       prefill_worker: DeploymentHandle | None = None):
        self.settings = settings
        info = load_model_info(settings.model)
        responses = RayResponseStore(settings.app_name, settings.responses_store_max_bytes,
                                     settings.responses_store_max_age_s)
        self.service = OpenAIService(worker, settings, info.tokenizer, RayAdapterStore(settings.app_name, settings.model),
                                     info.config, responses, prefill_worker)
        self.replicas: dict[str, dict[str, Any]] = {}
        self._poller = asyncio.get_running_loop().create_task(self._poll_replicas())

    async def _poll_replicas(self) -> None:
        """Follow the worker replicas' routing stats. A replica too busy to answer in time (a long
        compile) keeps its last report, so capacity does not shrink while it works."""
        settings = self.settings
        poller = ReplicaStatsPoller(settings.app_name, WORKER_DEPLOYMENT, wait_s=settings.stats_period_s)
        while True:
            try:
                self.replicas = await asyncio.to_thread(poller.poll)
                self.service.update_replicas(self.replicas)
                await self.service.catalog.refresh()
            except Exception as err:  # keep polling: a replica may be restarting
                logger.warning("reading worker routing stats failed: %r", err)
            await asyncio.sleep(settings.stats_period_s)

    def __serve_build_asgi_app__(self) -> Starlette:
        return self.service.asgi_app()

    async def queue_status(self) -> dict[str, Any]:
        """For ``raylm status``: this router replica's queue by class, slots in use and capacity."""
        return self.service.queue_status()
