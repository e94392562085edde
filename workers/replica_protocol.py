"""What crosses the wire between the router and a worker replica.

The worker streams deltas, never cumulative outputs: a cumulative ``RequestOutput`` per
step would ship O(n^2) tokens through Ray for a long completion.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from cluster.names import DEFAULT_APP_NAME, WORKER_DEPLOYMENT
from workers.beam_search import BeamSearchParams
from workers.engine_stats import EngineStats
from workers.outputs import RequestOutput, TokenLogprobs
from workers.sampling_params import SamplingParams


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


@dataclasses.dataclass(frozen=True)
class RoutingReport:
    """What a replica's ``record_routing_stats`` answers (Serve ships it as a plain dict): its
    engine's stats, its node, and the hashes of the KV blocks it caches (bounded) for
    prefix-aware routing."""

    engine: EngineStats
    node_id: str
    block_hashes: list[int]

    def as_dict(self) -> dict[str, Any]:
        return {"engine": self.engine.as_dict(), "node_id": self.node_id, "block_hashes": self.block_hashes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoutingReport:
        return cls(EngineStats.from_dict(data["engine"]), data["node_id"], data["block_hashes"])


def replica_reports(app_name: str = DEFAULT_APP_NAME, timeout_s: float = 10.0) -> dict[str, RoutingReport]:
    """``{replica id: report}`` of every live worker replica of ``app_name`` (needs Ray; those
    that do not answer within ``timeout_s`` are left out)."""
    from cluster.replicas import replica_stats

    return {rid: RoutingReport.from_dict(data) for rid, data in
            replica_stats(app_name, WORKER_DEPLOYMENT, timeout_s).items()}

