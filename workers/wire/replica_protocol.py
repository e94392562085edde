"""What crosses the wire between the router and a worker replica: the request, its streamed
chunks, the errors a replica answers with, and a replica's routing report.

Plain data, and the router's only view of the engine: this module and the ones it imports
(sampling parameters, engine counters, output logprobs) load no JAX, so a router replica
never loads the engine (tests/router/test_wire_imports.py).

The worker streams deltas, never cumulative outputs: a cumulative ``RequestOutput`` per
step would ship O(n^2) tokens through Ray for a long completion.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from raylm.cluster.names import DEFAULT_APP_NAME, PREFILL_WORKER_DEPLOYMENT, WORKER_DEPLOYMENT
from raylm.workers.core.engine_stats import EngineStats
from raylm.workers.core.lora_adapters import LoRARequest
from raylm.workers.core.request_output import TokenLogprobs
from raylm.workers.core.sampling_params import BeamSearchParams, SamplingParams

# What a worker replica does (deploy file's ``workers.role``): ``both`` computes prompts and streams
# outputs; beside ``prefill`` replicas, which compute prompts and publish their KV blocks to the
# cluster tier, ``decode`` replicas load those blocks and stream.
WORKER_ROLES = ("both", "prefill", "decode")


class InvalidRequestError(ValueError):
    """The engine refused the request as given (prompt too long for the pool, bad token ids)."""


class ReplicaDrainingError(RuntimeError):
    """The replica is shutting down and takes no new requests; another replica may."""


@dataclasses.dataclass
class GenerateRequest:
    """One tokenized request, as the router hands it to a replica."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first (vLLM's convention)
    block_hashes: list[int] = dataclasses.field(default_factory=list)  # of the prompt's full blocks, for routing
    embed: bool = False  # the prompt's embedding instead of a completion (the final chunk's ``embedding``)
    beam: BeamSearchParams | None = None  # beam search: ``beam_width`` completions in one final chunk
    # The LoRA adapter to generate with, as the router resolved the request's ``model`` (from the
    # deploy file or loaded over HTTP): the replica reads it on first use.
    lora: LoRARequest | None = None
    # Prefill/decode disaggregation (router/disaggregation.py). ``publish_kv``: a prefill hop; the
    # replica answers its last chunk only once every block it computed is in the KV tiers.
    # ``refresh_kv``: the decode that follows one; the replica syncs its view of the cluster tier
    # first, so its scheduler finds the blocks just published there.
    publish_kv: bool = False
    refresh_kv: bool = False


@dataclasses.dataclass
class ChoiceDelta:
    """New output of one of the ``n`` completions since the previous chunk."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None  # one entry per token in ``token_ids``
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    hidden_states: np.ndarray | None = None  # SamplingParams.return_hidden_states, with the finish


@dataclasses.dataclass
class GenerateChunk:
    """One engine step's progress for a request."""

    request_id: str
    choices: list[ChoiceDelta]
    prompt_tokens: int
    num_cached_tokens: int
    finished: bool
    embedding: list[float] | None = None  # embedding requests, in the final chunk


# How long a replica's periodic stats readers (Serve's autoscaling and routing callbacks) wait for
# a busy engine thread before taking its last figures; a report made later in one step says so.
PERIODIC_READ_WAIT_S = 1.0


@dataclasses.dataclass(frozen=True)
class RoutingReport:
    """What a replica's ``record_routing_stats`` answers (Serve ships it as a plain dict): its
    engine's stats, its node, the hashes of the KV blocks it caches (bounded) for prefix-aware
    routing, how long its engine thread had been in one step (or warm-up compile) when it
    answered (past ``PERIODIC_READ_WAIT_S`` the stats are those read before that step), and its
    role (one of ``WORKER_ROLES``)."""

    engine: EngineStats
    node_id: str
    block_hashes: list[int]
    busy_s: float = 0.0
    # Hashes of blocks a KV tier every replica loads from holds (cache/offload/; bounded): a
    # prompt starting with them costs a load, not a prefill, wherever it goes.
    shared_hashes: list[int] = dataclasses.field(default_factory=list)
    role: str = "both"
    # A replica split into pipeline stages: each stage's index, layers ``[start, stop)`` and node
    # (workers/pipeline/); empty for one that holds every layer.
    stages: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"engine": self.engine.as_dict(), "node_id": self.node_id, "block_hashes": self.block_hashes,
                "busy_s": self.busy_s, "shared_hashes": self.shared_hashes, "role": self.role, "stages": self.stages}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoutingReport:
        return cls(EngineStats.from_dict(data["engine"]), data["node_id"], data["block_hashes"],
                   data.get("busy_s", 0.0), data.get("shared_hashes", []), data.get("role", "both"),
                   data.get("stages", []))


def replica_reports(app_name: str = DEFAULT_APP_NAME, timeout_s: float = 10.0) -> dict[str, RoutingReport]:
    """``{replica id: report}`` of every live worker replica of ``app_name``, prefill replicas
    included (needs Ray; those that do not answer within ``timeout_s`` are left out)."""
    from raylm.cluster.replicas import replica_stats

    return {rid: RoutingReport.from_dict(data) for deployment in (WORKER_DEPLOYMENT, PREFILL_WORKER_DEPLOYMENT)
            for rid, data in replica_stats(app_name, deployment, timeout_s).items()}

