"""One replica's engine counters as one type: what metrics, request routing, autoscaling,
``raylm status`` and the benchmarks read, under one set of names.

``LLMEngine.stats()`` produces it; it crosses Ray as plain data (``as_dict`` / ``from_dict``)
inside a replica's routing-stats report.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from raylm.cache.block_pool import PoolStats
from raylm.cache.offload.tier import TierStats
from raylm.workers.core.speculation import SpecDecodeStats

if TYPE_CHECKING:
    from raylm.workers.core.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class LoraStats:
    """LoRA adapter slots (workers/core/lora_adapters.py): the adapters resident on the device (by
    slot), the slots running sequences hold, and lifetime slot fills and evictions per adapter."""

    resident: tuple[str, ...]
    in_use: int
    loads: dict[str, int]
    evictions: dict[str, int]


@dataclasses.dataclass(frozen=True)
class MoeStats:
    """A mixture-of-experts replica: its expert-parallel layout (an ``ep x tp`` device mesh,
    each device holding ``num_experts / ep`` experts of every sparse layer, model/runtime/sharding.py)
    and the tokens routed to each expert of each sparse layer since it started (load balance:
    the model computes them on the device, the engine reads them when it reports)."""

    expert_parallel_size: int
    tensor_parallel_size: int
    num_experts: int
    sparse_layers: tuple[int, ...]  # the decoder layers with experts
    routed_tokens: tuple[tuple[int, ...], ...]  # [sparse layer][expert]

    @property
    def experts_per_device(self) -> int:
        return self.num_experts // self.expert_parallel_size

    @property
    def imbalance(self) -> float:
        """The busiest expert's tokens over the mean expert's, worst layer (1.0: even; 0 before
        any token)."""
        ratios = [max(layer) * len(layer) / sum(layer) for layer in self.routed_tokens if sum(layer)]
        return max(ratios, default=0.0)


@dataclasses.dataclass(frozen=True)
class StepWork:
    """Lifetime totals of one kind of engine step (workers/engine/step_work.py): steps run, tokens the
    model computed in them, wall seconds of their programs (launch to results fetched) and the
    operations they did (model/decoder/flop_count.py: multiply and add counted apart)."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    flops: int = 0


@dataclasses.dataclass(frozen=True)
class ComputeStats:
    """What the replica's steps computed and how fast, per step kind (workers/engine/step_work.py).
    ``integer_matmuls``: the matrices ran in integers (``activation_quantization: int8``), so
    the operations are integer operations (GOP), not floating point ones."""

    integer_matmuls: bool
    kinds: dict[str, StepWork]


@dataclasses.dataclass(frozen=True)
class EngineStats:
    running: int  # sequences in the running queue
    waiting: int  # sequences in the waiting queue (new or preempted)
    waiting_tokens: int  # prompt work queued (preempted sequences recompute their outputs too)
    work_tokens: int  # the load a router compares replicas by: see ``remaining_work``
    tokens_stored: int  # tokens whose K/V the running sequences hold
    token_capacity: int  # tokens the blocks in use can hold
    num_preemptions: int  # lifetime counters from here on
    requests: int
    prompt_tokens: int  # prompt (and recomputed) tokens computed
    generation_tokens: int
    pool: PoolStats
    spec: SpecDecodeStats | None = None  # speculative decoding's counters; None when it is off
    lora: LoraStats | None = None  # LoRA adapter slots; None when LoRA is off
    moe: MoeStats | None = None  # experts' layout and load; None for a model without experts
    # The longest prompt the replica's KV pools can ever admit (None: only the context limits
    # it, its attention windows bound the blocks a sequence holds): the router refuses longer ones.
    max_prompt_tokens: int | None = None
    warmup_programs_left: int = 0  # programs still compiling in the background after start-up
    compute: ComputeStats | None = None  # work and time of the model's steps, per step kind
    loading: int = 0  # sequences waiting for KV blocks from an offload tier
    kv_offload: tuple[TierStats, ...] | None = None  # each offload tier's counters; None when offload is off
    # Prompt tokens looked up in the offload tiers beyond the pool's hits, and those loaded (lifetime;
    # vLLM's external prefix cache queries and hits)
    kv_offload_queried_tokens: int = 0
    kv_offload_loaded_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain data for a routing-stats report (Serve ships it between processes)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineStats:
        spec, lora, moe, compute = data.get("spec"), data.get("lora"), data.get("moe"), data.get("compute")
        tiers = data.get("kv_offload")
        if moe:
            moe = MoeStats(**{**moe, "sparse_layers": tuple(moe["sparse_layers"]),
                              "routed_tokens": tuple(tuple(layer) for layer in moe["routed_tokens"])})
        return cls(**{**data, "pool": PoolStats(**data["pool"]), "spec": SpecDecodeStats(**spec) if spec else None,
                      "lora": LoraStats(**{**lora, "resident": tuple(lora["resident"])}) if lora else None,
                      "moe": moe or None,
                      "compute": ComputeStats(compute["integer_matmuls"],
                                              {kind: StepWork(**work) for kind, work in compute["kinds"].items()})
                      if compute else None,
                      "kv_offload": tuple(TierStats(**tier) for tier in tiers) if tiers else None})


def remaining_work(seq: Sequence) -> int:
    """Tokens ``seq`` may still cost: those not computed yet (a waiting prompt counts whole: what
    the cache holds of it is known only at admission) and the outputs its ``max_tokens`` still
    allows (an upper bound: it may stop sooner). Not the tokens already held in the cache: a
    request whose long prompt was a cache hit costs little more than its outputs."""
    return seq.num_uncomputed_tokens + max(0, seq.max_tokens - len(seq.output_ids))
