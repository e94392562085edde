"""Feed a worker replica's engine into the metrics of ``cluster.metrics``.

Per request: token counts, latencies (TTFT, inter-token, queue, prefill, decode, end to end)
and the finish reason. Periodically: queue gauges, KV usage, the KV offload tiers' use and read
times, and the engine's cumulative counters (prefix cache, preemptions, speculation, tokens routed
per expert, offload tiers' blocks) turned into counter increments.
"""

from __future__ import annotations

import time
from typing import Sequence

from raylm.cache.offload.tier import TierStats
from raylm.cluster.metrics import WorkerMetrics, adapter_tag
from raylm.workers.core.engine_stats import EngineStats, LoraStats, MoeStats
from raylm.workers.core.request_output import CompletionOutput, RequestOutput
from raylm.workers.core.speculation import SpecDecodeStats


class RequestMetricsRecorder:
    """Watches one request's outputs as they stream; records everything once it ends (and, for
    a request with a LoRA adapter, its tokens and itself under the adapter's name)."""

    def __init__(self, metrics: WorkerMetrics, prompt_tokens: int = 0, lora_name: str | None = None):
        self.metrics = metrics
        self.lora_tags = {} if lora_name is None else {"lora_name": adapter_tag(lora_name)}
        self.start = time.monotonic()
        self.last_token_at: float | None = None
        self.first_token_at: float | None = None
        self.prompt_tokens = prompt_tokens
        self.generated = 0
        self.arrival: float | None = None
        self.first_scheduled: float | None = None
        self.finish_reasons: list[str] = []

    def on_output(self, output: RequestOutput) -> None:
        now = time.monotonic()
        self.prompt_tokens = len(output.prompt_token_ids)
        self.arrival = output.arrival_time or self.arrival
        self.first_scheduled = output.first_scheduled_time or self.first_scheduled
        new = sum(len(c.token_ids_delta) for c in output.outputs)
        if new:
            if self.first_token_at is None:
                self.first_token_at = now
                self.metrics.observe("raylm_time_to_first_token_seconds", now - (self.arrival or self.start))
                new_after_first = new - 1
            else:
                new_after_first = new
            if self.last_token_at is not None and new_after_first:
                gap = (now - self.last_token_at) / new_after_first  # multi-step decode delivers tokens in bursts
                for _ in range(new_after_first):
                    self.metrics.observe("raylm_inter_token_latency_seconds", gap)
            self.last_token_at = now
            self.generated += new
            self._count_tokens(new)
        if output.finished:
            self.finish_reasons = [c.finish_reason or "abort" for c in output.outputs]

    def on_beams(self, beams: Sequence[CompletionOutput]) -> None:
        """A beam search request answers once, at its end: its client's first token arrives
        with every beam's last, so its time to first token is its whole latency."""
        now = time.monotonic()
        self.first_token_at = self.last_token_at = now
        self.metrics.observe("raylm_time_to_first_token_seconds", now - self.start)
        self.generated = sum(len(b.token_ids) for b in beams)
        self._count_tokens(self.generated)
        self.finish_reasons = [b.finish_reason or "abort" for b in beams]

    def _count_tokens(self, tokens: int) -> None:
        self.metrics.inc("raylm_generation_tokens_total", tokens)
        if self.lora_tags:
            self.metrics.inc("raylm_lora_generation_tokens_total", tokens, **self.lora_tags)

    def finish(self) -> None:
        """Called once when the stream ends, normally or not (a cancelled stream is an abort)."""
        now = time.monotonic()
        arrival = self.arrival or self.start
        metrics = self.metrics
        metrics.inc("raylm_prompt_tokens_total", self.prompt_tokens)
        if self.lora_tags:
            metrics.inc("raylm_lora_requests_total", 1, **self.lora_tags)
        for reason in self.finish_reasons or ["abort"]:
            metrics.inc("raylm_request_success_total", 1, finished_reason=reason)
        metrics.observe("raylm_e2e_request_latency_seconds", now - arrival)
        metrics.observe("raylm_request_prompt_tokens", self.prompt_tokens)
        metrics.observe("raylm_request_generation_tokens", self.generated)
        if self.first_scheduled is not None:
            metrics.observe("raylm_request_queue_time_seconds", self.first_scheduled - arrival)
            if self.first_token_at is not None:
                metrics.observe("raylm_request_prefill_time_seconds", self.first_token_at - self.first_scheduled)
        if self.first_token_at is not None:
            metrics.observe("raylm_request_decode_time_seconds", now - self.first_token_at)


class EngineStatsReporter:
    """Turns periodic engine stats snapshots into gauges and counter increments."""

    def __init__(self, metrics: WorkerMetrics):
        self.metrics = metrics
        self.previous: EngineStats | None = None

    def report(self, stats: EngineStats) -> None:
        metrics, previous = self.metrics, self.previous
        metrics.set("raylm_num_requests_running", stats.running)
        metrics.set("raylm_num_requests_waiting", stats.waiting)
        metrics.set("raylm_num_requests_loading", stats.loading)
        metrics.set("raylm_kv_cache_usage_perc", stats.pool.usage)
        # The pool counts prompt tokens, as vLLM's prefix-cache counters do.
        for name, now, before in (
            ("raylm_prefix_cache_queries_total", stats.pool.prefix_queries,
             previous.pool.prefix_queries if previous else 0),
            ("raylm_prefix_cache_hits_total", stats.pool.prefix_hits, previous.pool.prefix_hits if previous else 0),
            ("raylm_num_preemptions_total", stats.num_preemptions, previous.num_preemptions if previous else 0),
            ("raylm_external_prefix_cache_queries_total", stats.kv_offload_queried_tokens,
             previous.kv_offload_queried_tokens if previous else 0),
            ("raylm_external_prefix_cache_hits_total", stats.kv_offload_loaded_tokens,
             previous.kv_offload_loaded_tokens if previous else 0),
        ):
            metrics.inc(name, now - before)
        if stats.spec is not None:
            self._report_speculation(stats.spec, previous.spec if previous and previous.spec else SpecDecodeStats())
        if stats.lora is not None:
            self._report_lora(stats.lora, previous.lora if previous else None)
        if stats.moe is not None:
            self._report_experts(stats.moe, previous.moe if previous else None)
        if stats.kv_offload is not None:
            self._report_kv_offload(stats.kv_offload, previous.kv_offload if previous else None)
        self.previous = stats
        memory = device_memory_in_use()
        if memory is not None:
            metrics.set("raylm_device_memory_used_bytes", memory)

    def _report_lora(self, lora: LoraStats, before: LoraStats | None) -> None:
        for name, now, then in (("raylm_lora_loads_total", lora.loads, before.loads if before else {}),
                                ("raylm_lora_evictions_total", lora.evictions, before.evictions if before else {})):
            for adapter, count in now.items():
                self.metrics.inc(name, count - then.get(adapter, 0), lora_name=adapter_tag(adapter))

    def _report_experts(self, moe: MoeStats, before: MoeStats | None) -> None:
        """Each (layer, expert)'s newly routed tokens, tagged by decoder layer and expert index."""
        for i, (layer, routed) in enumerate(zip(moe.sparse_layers, moe.routed_tokens)):
            for expert, tokens in enumerate(routed):
                then = before.routed_tokens[i][expert] if before else 0
                self.metrics.inc("raylm_moe_routed_tokens_total", tokens - then, layer=str(layer), expert=str(expert))

    def _report_kv_offload(self, tiers: tuple[TierStats, ...], before: tuple[TierStats, ...] | None) -> None:
        """Each tier's new blocks (hits, misses, stored, evicted), bytes read and errors by kind as
        counter increments; its bytes held and capacity as gauges; the durations of its reads since
        the snapshot before into the histogram (the newest ``loads - previous loads`` of those a
        snapshot keeps: other readers take snapshots too, so none is handed over and cleared)."""
        previous = {tier.tier: tier for tier in before or ()}
        for tier in tiers:
            then = previous.get(tier.tier) or TierStats(tier.tier, tier.capacity_bytes)
            tag = {"tier": tier.tier}
            for name, now, was in (("raylm_kv_offload_hits_total", tier.hits, then.hits),
                                   ("raylm_kv_offload_misses_total", tier.misses, then.misses),
                                   ("raylm_kv_offload_stored_total", tier.stored, then.stored),
                                   ("raylm_kv_offload_evicted_total", tier.evicted, then.evicted),
                                   ("raylm_kv_offload_load_bytes_total", tier.load_bytes, then.load_bytes)):
                self.metrics.inc(name, now - was, **tag)
            for kind, count in tier.errors.items():
                self.metrics.inc("raylm_kv_offload_errors_total", count - then.errors.get(kind, 0), kind=kind, **tag)
            self.metrics.set("raylm_kv_offload_stored_bytes", tier.stored_bytes, **tag)
            self.metrics.set("raylm_kv_offload_capacity_bytes", tier.capacity_bytes, **tag)
            new_loads = tier.loads - then.loads  # beyond the RECENT_LOADS a snapshot keeps, the oldest are lost
            for seconds in tier.recent_load_seconds[-new_loads:] if new_loads > 0 else ():
                self.metrics.observe("raylm_kv_offload_load_seconds", seconds, **tag)

    def _report_speculation(self, spec: SpecDecodeStats, before: SpecDecodeStats) -> None:
        for name, now, then in (
            ("raylm_spec_decode_num_drafts_total", spec.num_drafts, before.num_drafts),
            ("raylm_spec_decode_num_draft_tokens_total", spec.num_draft_tokens, before.num_draft_tokens),
            ("raylm_spec_decode_num_accepted_tokens_total", spec.num_accepted_tokens, before.num_accepted_tokens),
        ):
            self.metrics.inc(name, now - then)
        for position, count in enumerate(spec.accepted_per_pos):
            previous = before.accepted_per_pos[position] if position < len(before.accepted_per_pos) else 0
            self.metrics.inc("raylm_spec_decode_num_accepted_tokens_per_pos", count - previous, position=str(position))


def device_memory_in_use() -> int | None:
    """Bytes in use on the first accelerator, from JAX; None on CPU (no memory stats there)."""
    import jax

    device = jax.local_devices()[0]
    if device.platform == "cpu":
        return None
    stats = device.memory_stats() or {}
    return stats.get("bytes_in_use")
