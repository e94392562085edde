"""Every metric raylm exports, defined in one place.

Emitted with ``ray.util.metrics``, so they reach Ray's metrics endpoint (``ray start
--metrics-export-port``), the Ray dashboard and Prometheus. Ray prefixes every name with
``ray_`` (``raylm_num_requests_running`` is scraped as ``ray_raylm_num_requests_running``).
Names, units and meaning mirror vLLM's (``vllm:num_requests_running`` ->
``raylm_num_requests_running``) so existing dashboards map one to one. Every metric carries
the served ``model_name``; worker metrics also carry the ``replica``.
"""

from __future__ import annotations

import hashlib
import re

from ray.util.metrics import Counter, Gauge, Histogram

MAX_TENANT_TAGS = 1000  # distinct tenant tag values per router replica; the rest count as "other"
_PLAIN_TAG = re.compile(r"[A-Za-z0-9_.:@+-]{1,64}")

# Seconds: from 1 ms to 10 min, dense where interactive latencies live (vLLM's buckets).
LATENCY_BUCKETS_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0, 160.0, 640.0]
ITL_BUCKETS_S = [0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
# Seconds one read from a KV offload tier takes: from 0.1 ms (a host memory copy of a few blocks)
# to the cluster tier's default load timeout (10 s) and beyond.
KV_LOAD_BUCKETS_S = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0, 30.0]

# name -> (kind, description); the dashboard test checks its queries against these names.
WORKER_METRICS = {
    "raylm_num_requests_running": ("gauge", "Requests in the engine's running batch."),
    "raylm_num_requests_waiting": ("gauge", "Requests waiting in the engine's queue."),
    "raylm_num_requests_loading": ("gauge", "Requests waiting for KV blocks from an offload tier."),
    "raylm_kv_cache_usage_perc": ("gauge", "Fraction of KV cache blocks in use (0..1)."),
    "raylm_device_memory_used_bytes": ("gauge", "Accelerator memory in use (absent on CPU)."),
    "raylm_prompt_tokens_total": ("counter", "Prompt tokens of finished requests."),
    "raylm_generation_tokens_total": ("counter", "Generated tokens."),
    "raylm_prefix_cache_queries_total": ("counter", "Prompt tokens looked up in the prefix cache."),
    "raylm_prefix_cache_hits_total": ("counter", "Prompt tokens found in the prefix cache."),
    "raylm_external_prefix_cache_queries_total": (
        "counter", "Prompt tokens looked up in the KV offload tiers (beyond the prefix cache's hits)."),
    "raylm_external_prefix_cache_hits_total": ("counter", "Prompt tokens loaded from the KV offload tiers."),
    "raylm_num_preemptions_total": ("counter", "Sequences preempted (recomputed later)."),
    "raylm_request_success_total": ("counter", "Finished requests, by finished_reason (stop, length, abort)."),
    "raylm_time_to_first_token_seconds": ("histogram", "Arrival at the engine to first generated token."),
    "raylm_inter_token_latency_seconds": ("histogram", "Time between successive generated tokens."),
    "raylm_e2e_request_latency_seconds": ("histogram", "Arrival at the engine to the last token."),
    "raylm_request_queue_time_seconds": ("histogram", "Time a request waited in the engine before running."),
    "raylm_request_prefill_time_seconds": ("histogram", "First scheduled to first token."),
    "raylm_request_decode_time_seconds": ("histogram", "First token to the last token."),
    "raylm_request_prompt_tokens": ("histogram", "Prompt length per request."),
    "raylm_request_generation_tokens": ("histogram", "Generated tokens per request."),
    "raylm_iteration_tokens_total": ("histogram", "Tokens processed per engine step."),
    "raylm_spec_decode_num_drafts_total": ("counter", "Verified sequence steps that carried speculative guesses."),
    "raylm_spec_decode_num_draft_tokens_total": ("counter", "Speculative guesses scored by the model."),
    "raylm_spec_decode_num_accepted_tokens_total": ("counter", "Speculative guesses the model accepted."),
    "raylm_spec_decode_num_accepted_tokens_per_pos": ("counter", "Accepted guesses by position in the draft."),
    "raylm_lora_requests_total": ("counter", "Finished requests per LoRA adapter (lora_name)."),
    "raylm_lora_generation_tokens_total": ("counter", "Generated tokens per LoRA adapter."),
    "raylm_lora_loads_total": ("counter", "LoRA adapters written into a device slot, per adapter."),
    "raylm_lora_evictions_total": ("counter", "LoRA adapters evicted from a device slot, per adapter."),
    "raylm_moe_routed_tokens_total": ("counter", "Tokens routed to each expert of each MoE layer (load balance)."),
    # KV offload tiers (cache/offload/), per tier: host, disk, cluster. Counted in blocks unless named bytes.
    "raylm_kv_offload_hits_total": ("counter", "KV blocks a load asked an offload tier for and got."),
    "raylm_kv_offload_misses_total": ("counter", "KV blocks a load asked an offload tier for and did not get."),
    "raylm_kv_offload_stored_total": ("counter", "KV blocks written into an offload tier."),
    "raylm_kv_offload_evicted_total": ("counter", "KV blocks an offload tier dropped to make room."),
    "raylm_kv_offload_load_bytes_total": ("counter", "Bytes read out of an offload tier."),
    "raylm_kv_offload_errors_total": ("counter", "Offload tier failures by kind (each costs a recompute)."),
    "raylm_kv_offload_stored_bytes": ("gauge", "Bytes an offload tier holds."),
    "raylm_kv_offload_capacity_bytes": ("gauge", "Bytes an offload tier may hold."),
    "raylm_kv_offload_load_seconds": ("histogram", "Time of one read from an offload tier."),
}
# Worker metrics with a tag beyond model_name and replica.
_WORKER_TAGS = {
    "raylm_request_success_total": ("finished_reason",),
    "raylm_spec_decode_num_accepted_tokens_per_pos": ("position",),
    **{name: ("lora_name",) for name in WORKER_METRICS if name.startswith("raylm_lora_")},
    "raylm_moe_routed_tokens_total": ("layer", "expert"),
    **{name: ("tier",) for name in WORKER_METRICS if name.startswith("raylm_kv_offload_")},
    "raylm_kv_offload_errors_total": ("tier", "kind"),
}
ROUTER_METRICS = {
    "raylm_router_queue_depth": ("gauge", "Requests waiting in the router queue, per priority class."),
    "raylm_router_queue_time_seconds": ("histogram", "Time a request waited in the router queue."),
    "raylm_router_requests_rejected_total": ("counter", "Requests refused by the router, by status and reason."),
    "raylm_router_routing_decisions_total": ("counter", "Worker replica choices, by reason."),
    "raylm_router_tenant_tokens_total": ("counter", "Tokens served per tenant (prompt + generated)."),
    "raylm_router_requests_total": ("counter", "Generation requests answered, by endpoint and HTTP status."),
    "raylm_router_pd_prefill_seconds": ("histogram", "Disaggregation: a prompt's prefill hop, sent to published."),
    "raylm_router_pd_fallbacks_total": ("counter", "Disaggregation: prefills that failed, by reason; their decode "
                                                   "replica computed the prompt."),
}


def _make(name: str, table: dict[str, tuple[str, str]], tags: tuple[str, ...], buckets=None):
    kind, description = table[name]
    if kind == "gauge":
        return Gauge(name, description=description, tag_keys=tags)
    if kind == "counter":
        return Counter(name, description=description, tag_keys=tags)
    return Histogram(name, description=description, boundaries=buckets, tag_keys=tags)


class WorkerMetrics:
    """One worker replica's engine metrics."""

    def __init__(self, model: str, replica: str):
        self.tags = {"model_name": model, "replica": replica}
        keys = ("model_name", "replica")
        latency = {"raylm_time_to_first_token_seconds", "raylm_e2e_request_latency_seconds",
                   "raylm_request_queue_time_seconds", "raylm_request_prefill_time_seconds",
                   "raylm_request_decode_time_seconds"}
        buckets = {**{name: LATENCY_BUCKETS_S for name in latency}, "raylm_inter_token_latency_seconds": ITL_BUCKETS_S,
                   "raylm_kv_offload_load_seconds": KV_LOAD_BUCKETS_S}
        self.m = {name: _make(name, WORKER_METRICS, keys + _WORKER_TAGS.get(name, ()), buckets.get(name, TOKEN_BUCKETS))
                  for name in WORKER_METRICS}

    def set(self, name: str, value: float, **tags: str) -> None:
        self.m[name].set(value, tags={**self.tags, **tags})

    def inc(self, name: str, value: float, **tags: str) -> None:
        if value > 0:
            self.m[name].inc(value, tags={**self.tags, **tags})

    def observe(self, name: str, value: float, **tags: str) -> None:
        self.m[name].observe(value, tags={**self.tags, **tags})


class RouterMetrics:
    """The ingress and its request router: queueing, rejections, routing decisions, tenants."""

    def __init__(self, model: str):
        self.model = model
        keys = ("model_name",)
        self._queue_depth = _make("raylm_router_queue_depth", ROUTER_METRICS, keys + ("priority",))
        self._queue_time = _make("raylm_router_queue_time_seconds", ROUTER_METRICS, keys + ("priority",),
                                 LATENCY_BUCKETS_S)
        self._rejected = _make("raylm_router_requests_rejected_total", ROUTER_METRICS, keys + ("status", "reason"))
        self._routing = _make("raylm_router_routing_decisions_total", ROUTER_METRICS, keys + ("reason",))
        self._tenant_tokens = _make("raylm_router_tenant_tokens_total", ROUTER_METRICS, keys + ("tenant",))
        self._requests = _make("raylm_router_requests_total", ROUTER_METRICS, keys + ("endpoint", "status"))
        self._prefill_seconds = _make("raylm_router_pd_prefill_seconds", ROUTER_METRICS, keys, LATENCY_BUCKETS_S)
        self._pd_fallbacks = _make("raylm_router_pd_fallbacks_total", ROUTER_METRICS, keys + ("reason",))
        self._tenant_tags: set[str] = set()

    def queue_depth(self, priority: str, depth: int) -> None:
        self._queue_depth.set(depth, tags={"model_name": self.model, "priority": priority})

    def queue_time(self, priority: str, seconds: float) -> None:
        self._queue_time.observe(seconds, tags={"model_name": self.model, "priority": priority})

    def rejected(self, status: int, reason: str) -> None:
        self._rejected.inc(1, tags={"model_name": self.model, "status": str(status), "reason": reason})

    def request(self, endpoint: str, status: int) -> None:
        """A generation request answered (``endpoint``: its route's path), streams at their start."""
        self._requests.inc(1, tags={"model_name": self.model, "endpoint": endpoint, "status": str(status)})

    def prefill_seconds(self, seconds: float) -> None:
        """A disaggregated request's prefill hop succeeded after ``seconds``."""
        self._prefill_seconds.observe(seconds, tags={"model_name": self.model})

    def pd_fallback(self, reason: str) -> None:
        """A prefill hop failed (``timeout``, ``overloaded``, ``error``): the decode replica computes the prompt."""
        self._pd_fallbacks.inc(1, tags={"model_name": self.model, "reason": reason})

    def routing_decision(self, reason: str) -> None:
        self._routing.inc(1, tags={"model_name": self.model, "reason": reason})

    def tenant_tokens(self, tenant: str, tokens: int) -> None:
        if tokens:
            self._tenant_tokens.inc(tokens, tags={"model_name": self.model, "tenant": self._tenant_tag(tenant)})

    def _tenant_tag(self, tenant: str) -> str:
        """A bounded set of tag values: the tenant comes from the client (``user``)."""
        tag = tenant_tag(tenant)
        if tag not in self._tenant_tags:
            if len(self._tenant_tags) >= MAX_TENANT_TAGS:
                return "other"
            self._tenant_tags.add(tag)
        return tag


def adapter_tag(name: str) -> str:
    """A LoRA adapter's name as a metric tag value: kept when Ray can record it (printable
    ASCII; names like ``org/adapter`` stay readable), else a stable hash. Names come from the
    deploy file or an admin's load request, so their number stays bounded."""
    if name.isascii() and name.isprintable() and len(name) <= 128:
        return name
    return "h-" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def tenant_tag(tenant: str) -> str:
    """``tenant`` as a metric tag value: kept when it is short plain ASCII, else a stable hash.

    Ray's metric recorder accepts ASCII only (a tag like ``josé`` raises inside ``inc``), and a
    client's ``user`` field may hold anything, lone surrogates included."""
    if _PLAIN_TAG.fullmatch(tenant):
        return tenant
    return "h-" + hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:16]
