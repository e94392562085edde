"""Autoscaling the worker deployment on what limits an LLM replica: batch slots and KV memory.

Serve's default policy counts ongoing requests. raylm's router keeps its own queue and only
sends a replica as many requests as it has batch slots, so a replica's request count tops out
at ``max_num_seqs`` whatever the backlog; what tells an overloaded replica from a busy one is
how full its batch is, how full its KV cache is, and whether prompts wait in its engine.
Each replica reports these (``LLMWorker.record_autoscaling_stats``); Serve averages them over
``look_back_period_s`` and applies min/max replicas and the up/down-scale delays around this
policy.
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingContext

POLICY_IMPORT_PATH = "raylm.cluster.autoscaling:LLMAutoscalingPolicy"


class LLMAutoscalingPolicy:
    """Desired replicas = current x the worst ratio of (batch use, KV use, queued tokens) to target."""

    def __init__(self, target_batch_utilization: float = 0.75, target_kv_usage: float = 0.8,
                 target_waiting_tokens: float = 2048.0):
        self.target_batch_utilization = target_batch_utilization
        self.target_kv_usage = target_kv_usage
        self.target_waiting_tokens = target_waiting_tokens

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        current = ctx.current_num_replicas
        if current == 0:
            return ctx.target_num_replicas, {}
        metrics = ctx.aggregated_metrics or {}
        utilization = _mean(metrics.get("batch_utilization"))
        kv = _mean(metrics.get("kv_usage"))
        waiting = _mean(metrics.get("waiting_tokens"))
        if utilization is None:  # no reports yet: keep the current size
            return ctx.target_num_replicas, {}
        pressure = max(
            utilization / self.target_batch_utilization,
            (kv or 0.0) / self.target_kv_usage,
            (waiting or 0.0) / self.target_waiting_tokens,
        )
        return current * pressure, {"last_pressure": pressure}


def _mean(per_replica: dict | None) -> float | None:
    if not per_replica:
        return None
    return sum(per_replica.values()) / len(per_replica)
