"""Every metric raylm exports, defined in one place.

Emitted with ``ray.util.metrics``, so they reach Ray's metrics endpoint (``ray start
--metrics-export-port``), the Ray dashboard and Prometheus. Ray prefixes every name with
``ray_``: ``raylm_router_requests_rejected_total`` is scraped as
``ray_raylm_router_requests_rejected_total``. Names mirror vLLM's where one exists.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge


class RouterMetrics:
    """The ingress and its request router: queueing, rejections, routing decisions, tenants."""

    def __init__(self, model: str):
        self.model = model
        self._queue_depth = Gauge(
            "raylm_router_queue_depth", description="Requests waiting in the router queue, per priority class.",
            tag_keys=("model", "priority"),
        )
        self._rejected = Counter(
            "raylm_router_requests_rejected_total",
            description="Requests refused by the router, by HTTP status and reason.",
            tag_keys=("model", "status", "reason"),
        )
        self._routing = Counter(
            "raylm_router_routing_decisions_total",
            description="Worker replica choices, by reason (prefix_hit, load_imbalance, no_prefix, fallback).",
            tag_keys=("model", "reason"),
        )
        self._tenant_tokens = Counter(
            "raylm_router_tenant_tokens_total", description="Tokens served per tenant (prompt + generated).",
            tag_keys=("model", "tenant"),
        )

    def queue_depth(self, priority: str, depth: int) -> None:
        self._queue_depth.set(depth, tags={"model": self.model, "priority": priority})

    def rejected(self, status: int, reason: str) -> None:
        self._rejected.inc(1, tags={"model": self.model, "status": str(status), "reason": reason})

    def routing_decision(self, reason: str) -> None:
        self._routing.inc(1, tags={"model": self.model, "reason": reason})

    def tenant_tokens(self, tenant: str, tokens: int) -> None:
        if tokens:
            self._tenant_tokens.inc(tokens, tags={"model": self.model, "tenant": tenant})
