"""The worker replica as a Ray Serve deployment: one model replica and its engine per actor.

Serve gives the replica its lifecycle: it calls ``check_health`` periodically (a stuck or
broken engine fails it and gets the replica restarted), ``record_routing_stats`` for request
routers, and on scale-down stops routing here, waits up to ``graceful_shutdown_timeout_s`` for
in-flight requests, then calls ``__del__``, which aborts what is left and stops the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import ray
from ray import serve

from raylm.cluster.metrics import WorkerMetrics
from raylm.cluster.names import WORKER_DEPLOYMENT
from raylm.model.quantization.quant_array import weight_bytes
from raylm.workers.core.engine_stats import EngineStats
from raylm.workers.core.lora_adapters import LoRARequest
from raylm.workers.core.request_output import RequestOutput
from raylm.workers.engine.async_engine import AsyncEngine, EngineShutdownError
from raylm.workers.engine.llm_engine import LLMEngine
from raylm.workers.pipeline.pipeline_runner import PipelineRunner, stage_locations
from raylm.workers.serve.deployment_options import DEFAULT_STUCK_AFTER_S, WorkerDeploymentOptions
from raylm.workers.serve.kv_handoff import publish_computed_kv, refresh_kv_mirror
from raylm.workers.serve.multihost_actors import start_mesh_engine
from raylm.workers.serve.replica_metrics import EngineStatsReporter, RequestMetricsRecorder
from raylm.workers.wire.replica_protocol import (
    PERIODIC_READ_WAIT_S,
    WORKER_ROLES,
    ChoiceDelta,
    GenerateChunk,
    GenerateRequest,
    ReplicaDrainingError,
    RoutingReport,
)

STAGE_PING_TIMEOUT_S = 10.0  # a pipeline stage that does not answer a ping in this long fails the health check

logger = logging.getLogger("ray.serve")

DEFAULT_MAX_REPORTED_HASHES = 4096  # 64k tokens of prefix at block size 16; ~40 KB per report


def chunk_from_output(output: RequestOutput, reported_finished: set[int]) -> GenerateChunk:
    """The deltas of ``output``; choices without progress are left out, and a finish is
    reported once (``reported_finished`` holds the indices already reported, and is updated)."""
    choices = []
    for completion in output.outputs:
        new_tokens = completion.token_ids_delta
        newly_finished = completion.finished and completion.index not in reported_finished
        if not (new_tokens or completion.text_delta or newly_finished):
            continue
        if newly_finished:
            reported_finished.add(completion.index)
        logprobs = None
        if completion.logprobs is not None:
            logprobs = completion.logprobs[len(completion.logprobs) - len(new_tokens) :]
        choices.append(
            ChoiceDelta(
                index=completion.index,
                text=completion.text_delta,
                token_ids=list(new_tokens),
                logprobs=logprobs,
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
                hidden_states=completion.hidden_states if newly_finished else None,
            )
        )
    return GenerateChunk(
        request_id=output.request_id,
        choices=choices,
        prompt_tokens=len(output.prompt_token_ids),
        num_cached_tokens=output.num_cached_tokens,
        finished=output.finished,
        embedding=output.embedding,
    )


@serve.deployment(name=WORKER_DEPLOYMENT, **WorkerDeploymentOptions().serve_options())
class LLMWorker:
    """One model replica serving ``generate`` streams. Its ``role`` (``WORKER_ROLES``) is what
    ``raylm status`` shows; the requests' own marks (``publish_kv``, ``refresh_kv``) say what to do."""

    async def __init__(
        self,
        model: str,
        engine_args: dict[str, Any],
        stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
        max_reported_hashes: int = DEFAULT_MAX_REPORTED_HASHES,
        served_model_name: str | None = None,
        metrics_period_s: float = 1.0,
        lora_modules: Sequence[LoRARequest] = (),
        role: str = "both",
        kv_handoff_timeout_s: float = 10.0,
    ):
        if role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {WORKER_ROLES}, got {role!r}")
        self.role = role
        self.kv_handoff_timeout_s = kv_handoff_timeout_s
        self.model = model
        self.max_reported_hashes = max_reported_hashes
        started = time.perf_counter()
        if engine_args.get("num_hosts", 1) > 1:  # this replica leads a mesh over several hosts
            self.engine = AsyncEngine(await asyncio.to_thread(start_mesh_engine, model, engine_args, True))
        else:
            self.engine = await asyncio.to_thread(AsyncEngine.from_model, model, **engine_args)
        built_s = time.perf_counter() - started
        # The deploy file's adapters, read now: one that cannot be served fails the replica's start,
        # naming it. Requests carry their adapter (router/lora_catalog.py), so those loaded over
        # HTTP need nothing here: a replica reads each on first use.
        for lora in lora_modules:  # on the engine thread: its adapter registry is not shared
            await self.engine.run_in_engine(lambda engine, lora=lora: engine.loras.add(lora))
        self.stuck_after_s = stuck_after_s
        self.draining = False
        replica = serve.get_replica_context().replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()
        self.stages = stage_locations(self.engine.llm_engine.runner, self.node_id)
        self.metrics = WorkerMetrics(served_model_name or model, replica)
        self.engine.step_observer = lambda tokens, seconds: self.metrics.observe("raylm_iteration_tokens_total", tokens)
        self._reporter = EngineStatsReporter(self.metrics)
        self._metrics_task = asyncio.get_running_loop().create_task(self._report_metrics(metrics_period_s))
        engine = self.engine.llm_engine
        logger.info("raylm worker ready: %s loaded and built in %.1f s (weights as held %.2f GiB), %d KV blocks; "
                    "the warm-up compiles in the background", model, built_s,
                    weight_bytes(engine.model.params) / 2**30, engine.pool.num_usable_blocks)

    async def _report_metrics(self, period_s: float) -> None:
        while True:
            try:
                self._reporter.report(await self.engine.stats())
            except Exception as err:  # metrics must never take the replica down
                logger.warning("reporting engine metrics failed: %r", err)
            await asyncio.sleep(period_s)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream deltas; a cancelled call (client gone) aborts the request and frees its blocks.

        A request the engine refuses raises InvalidRequestError (the router answers 400); an
        engine that stopped raises ReplicaDrainingError (503, retry: Serve replaces this replica);
        any other error, such as a failed step, is the server's (500).

        Disaggregation: a ``refresh_kv`` request first syncs this replica's view of the cluster
        tier (its prompt's blocks were just published there); a ``publish_kv`` request's last
        chunk comes only once the blocks it computed are in the tiers.
        """
        if self.draining:
            raise ReplicaDrainingError("this replica is shutting down; retry")
        if request.refresh_kv:
            await refresh_kv_mirror(self.engine.llm_engine, self.kv_handoff_timeout_s, request.request_id)
        lora = request.lora
        if request.beam is not None:
            yield await self._beam_search(request, lora)
            return
        reported: set[int] = set()
        started = False
        recorder = RequestMetricsRecorder(self.metrics, lora_name=None if lora is None else lora.lora_name)
        try:
            async for output in self.engine.generate(
                request.prompt_token_ids, request.params, request.request_id, request.priority, embed=request.embed,
                lora_request=lora,
            ):
                started = True
                recorder.on_output(output)
                if output.finished and request.publish_kv:
                    await publish_computed_kv(self.engine.llm_engine, self.kv_handoff_timeout_s, request.request_id)
                yield chunk_from_output(output, reported)
        except EngineShutdownError as err:  # the health check fails next; another replica can serve
            raise ReplicaDrainingError(f"this replica's engine stopped ({err}); retry") from None
        finally:
            if started:
                recorder.finish()

    async def _beam_search(self, request: GenerateRequest, lora: LoRARequest | None) -> GenerateChunk:
        """A beam search request's one chunk: every beam, finished (recorded as one request)."""
        recorder = RequestMetricsRecorder(self.metrics, prompt_tokens=len(request.prompt_token_ids),
                                          lora_name=None if lora is None else lora.lora_name)
        try:
            beams = await self.engine.beam_search(request.prompt_token_ids, request.beam, request.request_id, lora)
            recorder.on_beams(beams)
        except EngineShutdownError as err:
            raise ReplicaDrainingError(f"this replica's engine stopped ({err}); retry") from None
        finally:
            recorder.finish()
        choices = [ChoiceDelta(b.index, b.text, b.token_ids, None, b.finish_reason) for b in beams]
        return GenerateChunk(request.request_id, choices, len(request.prompt_token_ids), 0, True)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def check_health(self) -> None:
        self.engine.check_health(self.stuck_after_s)
        runner = self.engine.llm_engine.runner
        if isinstance(runner, PipelineRunner):  # a dead stage fails the replica, even an idle one
            await asyncio.to_thread(runner.check_stages, STAGE_PING_TIMEOUT_S)

    async def stats(self) -> EngineStats:
        """Engine counters (queue, KV pool, tokens, prefix cache, speculation)."""
        return await self.engine.stats()

    async def record_routing_stats(self) -> dict[str, Any]:
        """What request routers (and ``raylm status``) read: a ``RoutingReport`` as plain data."""

        def snapshot(engine) -> RoutingReport:
            limit, connector = self.max_reported_hashes, engine.kv_connector
            return RoutingReport(engine.stats(), self.node_id, engine.pool.cached_hashes(limit),
                                 shared_hashes=connector.shared_hashes(limit) if connector is not None else [],
                                 role=self.role, stages=self.stages)

        report = await self.engine.read_in_engine("routing", snapshot, PERIODIC_READ_WAIT_S)
        started = self.engine.step_started
        busy_s = 0.0 if started is None else max(0.0, time.monotonic() - started)
        return dataclasses.replace(report, busy_s=busy_s).as_dict()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom metrics for the LLM autoscaling policy (``cluster.autoscaling``); the last ones
        read while the engine thread is busy (a policy without reports keeps the size as is)."""
        stats = await self.engine.read_in_engine("stats", LLMEngine.stats, PERIODIC_READ_WAIT_S)
        slots = self.engine.llm_engine.args.max_num_seqs
        return {
            "batch_utilization": min(1.0, (stats.running + stats.waiting) / slots),
            "kv_usage": stats.pool.usage,
            "waiting_tokens": float(stats.waiting_tokens),
        }

    async def profile(self, seconds: float, out_dir: str) -> str:
        """Record a ``jax.profiler`` trace of this replica for ``seconds`` into ``out_dir``."""
        import jax

        target = Path(out_dir).expanduser() / f"raylm-{serve.get_replica_context().replica_id.unique_id}-{int(time.time())}"
        target.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(target))
        try:
            await asyncio.sleep(seconds)
        finally:
            jax.profiler.stop_trace()
        return str(target)

    async def __del__(self) -> None:
        """Serve already waited for in-flight requests; abort stragglers and stop the engine."""
        self.draining = True
        self._metrics_task.cancel()
        try:
            aborted = await self.engine.abort_all()
        except EngineShutdownError:  # the engine thread died; its callers were failed already
            aborted = 0
        if aborted:
            logger.warning("raylm worker shutting down: aborted %d unfinished request(s)", aborted)
        await asyncio.to_thread(self.engine.shutdown)
